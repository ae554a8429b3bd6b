"""Timed simulator against closed forms derived independently of it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp
from pdjax.schedules.ops import B, F, FB, I, W

costs = st.floats(0.1, 3.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 12), m=st.integers(1, 40), f=costs, b=costs)
def test_1f1b_makespan_bubble_ratio(p, m, f, b):
    t = pp.simulate(pp.build("1f1b", p, m), F=f, B=b, W=0.0)
    assert t.makespan == pytest.approx((m + p - 1) * (f + b))
    np.testing.assert_allclose(t.bubble, (p - 1) * (f + b), atol=1e-9)
    assert t.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert len(t.events) == 2 * p * m


@settings(max_examples=30, deadline=None)
@given(f=st.lists(costs, min_size=2, max_size=8), data=st.data())
def test_per_stage_arrays_single_microbatch(f, data):
    """One micro-batch through P heterogeneous stages: the critical path is every op."""
    p = len(f)
    b = data.draw(st.lists(costs, min_size=p, max_size=p))
    c = data.draw(st.floats(0.0, 1.0))
    t = pp.simulate(pp.build("1f1b", p, 1), F=f, B=b, W=0.0, comm=c)
    assert t.makespan == pytest.approx(sum(f) + sum(b) + 2 * (p - 1) * c)
    np.testing.assert_allclose(t.busy, np.array(f) + np.array(b))


def test_single_rank_is_serial():
    s = pp.build("dualpipev", 1, 4)
    t = pp.simulate(s, F=1.0, B=3.0, W=1.0, FB=3.5, comm=5.0)  # comm never paid on one rank
    assert t.bubble[0] == pytest.approx(0.0)
    assert t.makespan == pytest.approx(t.busy[0])


def test_events_respect_dependencies_and_rank_order():
    s = pp.build("dualpipe", 4, 12)
    c = 0.3
    t = pp.simulate(s, F=1.0, B=2.0, W=0.5, FB=2.2, comm=c)
    end = {}
    for e in t.events:
        for part in e.op.parts:
            if part.kind != "W":
                end[(part.kind in "BI", part.stage, part.microbatch)] = (e.end, e.rank)
    lay = s.layout
    for e in t.events:
        for part in e.op.parts:
            s_, m = part.stage, part.microbatch
            deps = []
            if part.kind == "F" and lay.prev_stage[s_] >= 0:
                deps.append((False, lay.prev_stage[s_], m))
            if part.kind in "BI":
                deps.append((False, s_, m))
                if lay.next_stage[s_] >= 0:
                    deps.append((True, lay.next_stage[s_], m))
            for d in deps:
                t_end, r = end[d]
                assert e.start >= t_end + (c if r != e.rank else 0.0) - 1e-9
    for r in range(s.num_ranks):
        assert np.all(t.starts[r][1:] >= t.ends[r][:-1] - 1e-12)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(F=-1.0), "F must be finite and > 0"),
    (dict(F=0.0), "F must be finite and > 0"),
    (dict(B=[1.0, 2.0]), "one entry per stage"),
    (dict(B=1.0, W=2.0), r"W \(2\) must not exceed B \(1\)"),
    (dict(comm=float("nan")), "comm must be finite"),
])
def test_bad_costs(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        pp.simulate(pp.build("1f1b", 4, 8), **kwargs)


def test_simulate_reports_deadlock_without_validation():
    s = pp.build("1f1b", 2, 2)
    f, b = F, B
    ops = ((f(0, 0), b(0, 0), f(0, 1), b(0, 1)), (f(1, 0), f(1, 1), b(1, 0), b(1, 1)))
    bad = pp.Schedule("t", s.layout, ops)
    with pytest.raises(pp.DeadlockError):
        pp.simulate(bad, check=False)


# ---- memory: W-aware activation units and the per-stage byte model ---------------------

def _reference_peaks(schedule, mem_f, mem_i, mem_i_free):
    """Independent of the simulator's event sort: walk each rank's program in order
    (ops on a rank never overlap): an op's allocations at its start, then its frees at
    its end. Per part: F allocates F; I allocates I and frees I_free; W frees
    F + I - I_free; B frees F."""
    out = []
    for ops in schedule.ops:
        cur = peak = 0
        for op in ops:
            for p in op.parts:
                cur += {"F": mem_f, "I": mem_i}.get(p.kind, [0] * len(mem_f))[p.stage]
            peak = max(peak, cur)
            for p in op.parts:
                s = p.stage
                cur -= {"B": mem_f[s], "I": mem_i_free[s], "W": mem_f[s] + mem_i[s] - mem_i_free[s]}.get(p.kind, 0)
        out.append(peak)
    return out


def test_zb1p_holds_p_activations_on_every_rank():
    """ZB-H1 keeps every rank at P activations (zero-bubble paper): a W still needs its
    micro-batch's stage inputs and output gradients. (Freeing at I gave 8, 7, ..., 1.)"""
    t = pp.simulate(pp.build("zb1p", 8, 20), F=1.0, B=2.0, W=1.0)
    assert t.peak_activations.tolist() == [8] * 8
    np.testing.assert_array_equal(t.peak_memory, np.full(8, 8.0))


def test_weighted_memory_by_hand_zb1p_2x3():
    """zb1p, 2 ranks x 3 micro-batches, F=1, B=2, W=1, memory F=10, I=3, I_free=4 (so a W
    frees 10 + 3 - 4 = 9). Programs and running totals (op starts allocate, ends free):

    rank 0: 0F0 +10=10 | 0F1 +10=20 | 0I0 +3=23, -4=19 | 0W0 -9=10 | 0F2 +10=20 |
            0I1 +3=23, -4=19 | 0W1 -9=10 | 0I2 +3=13, -4=9 | 0W2 -9=0        -> peak 23
    rank 1: 1F0 +10=10 | 1I0 +3=13, -4=9 | 1F1 +10=19 | 1I1 +3=22, -4=18 | 1W0 -9=9 |
            1F2 +10=19 | 1I2 +3=22, -4=18 | 1W1 -9=9 | 1W2 -9=0             -> peak 22
    Units (F=1, W frees 1): rank 0 peaks at 2 (0F0, 0F1), rank 1 at 2 (1F1 before 1W0);
    freeing at I would give rank 1 only 1, and rank 1's bytes 13."""
    s = pp.build("zb1p", 2, 3)
    assert [[str(op) for op in ops] for ops in s.ops] == [
        ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0I2", "0W2"],
        ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1W2"]]
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0, memory={"F": 10, "I": 3, "I_free": 4})
    np.testing.assert_array_equal(t.peak_memory, [23.0, 22.0])
    assert t.peak_activations.tolist() == [2, 2]
    assert t.peak_memory.dtype == float
    np.testing.assert_array_equal(t.memory["I_free"], [4.0, 4.0])


def test_weighted_memory_overlapped_pair_by_hand():
    """One stage on one rank: 0F0, 0F1, 0I0, (0F2;0I1), 0W0, 0W1, 0I2, 0W2 with memory
    F=10, I=3, I_free=4 (a W frees 9). The pair allocates its forward's 10 and its I's 3
    at its start and frees the I's 4 only at its end:
    0F0 10 | 0F1 20 | 0I0 +3=23, -4=19 | pair +13=32, -4=28 | 0W0 -9=19 | 0W1 -9=10 |
    0I2 +3=13, -4=9 | 0W2 -9=0 -> peak 32 (freeing the pair's backward part before its
    forward allocates would give 28). Units: 0F0 1, 0F1 2, 0I0 2 (an I frees none),
    pair 3, then down -> 3 (freeing at I would give 2)."""
    f, i, w = F, I, W
    ops = ((f(0, 0), f(0, 1), i(0, 0), FB(f(0, 2), i(0, 1)), w(0, 0), w(0, 1), i(0, 2), w(0, 2)),)
    s = pp.Schedule("pair", pp.Layout.chain((0,), 3), ops)
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5, memory={"F": 10, "I": 3, "I_free": 4})
    np.testing.assert_array_equal(t.peak_memory, [32.0])
    assert t.peak_activations.tolist() == [3]


@pytest.mark.parametrize("name,ranks,mb", [("1f1b", 4, 9), ("zb1p", 5, 7), ("dualpipe", 4, 12),
                                           ("dualpipev", 3, 8), ("interleaved-1f1b", 2, 4)])
def test_no_memory_model_is_activation_units(name, ranks, mb):
    s = pp.build(name, ranks, mb)
    t = pp.simulate(s, F=1.0, B=2.0, W=0.5, FB=2.5)
    assert t.peak_memory.dtype == float
    np.testing.assert_array_equal(t.peak_memory, t.peak_activations.astype(float))
    np.testing.assert_array_equal(pp.simulate(s, F=1.0, B=2.0, W=0.5, FB=2.5, memory={}).peak_memory,
                                  t.peak_memory)
    ones = [1] * s.num_stages
    assert t.peak_activations.tolist() == _reference_peaks(s, ones, [0] * s.num_stages, [0] * s.num_stages)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["1f1b", "zb1p", "dualpipe", "dualpipev", "gpipe"]), n=st.integers(1, 4),
       extra=st.integers(0, 5), f=costs, i=costs, w=costs, over=st.floats(0.0, 2.0), c=st.floats(0.0, 1.0),
       data=st.data())
def test_weighted_memory_matches_program_order_reference(name, n, extra, f, i, w, over, c, data):
    """Per-stage byte amounts (integers, so sums are exact) against the program-order walk."""
    ranks = 2 * n if name == "dualpipe" else n
    s = pp.build(name, ranks, 2 * ranks + 2 * extra)
    ints = st.integers(0, 1000)
    mf = data.draw(st.lists(ints, min_size=s.num_stages, max_size=s.num_stages))
    mi = data.draw(st.lists(ints, min_size=s.num_stages, max_size=s.num_stages))
    mfree = [data.draw(st.integers(0, x)) for x in mf]
    t = pp.simulate(s, F=f, B=i + w, W=w, FB=max(f, i + w) + over, comm=c,
                    memory={"F": mf, "I": mi, "I_free": mfree})
    assert t.peak_memory.tolist() == _reference_peaks(s, mf, mi, mfree)
    ones = [1] * s.num_stages
    assert t.peak_activations.tolist() == _reference_peaks(s, ones, [0] * s.num_stages, [0] * s.num_stages)


@pytest.mark.parametrize("memory,error,pattern", [
    ({"F": 1, "A": 2}, ValueError, "unknown memory key 'A'"),
    ({"F": -1.0}, ValueError, r"memory\['F'\] must be finite and >= 0, got -1.0 at stage 0"),
    ({"I": [0.0, 0.0, float("nan"), 0.0]}, ValueError, r"memory\['I'\] must be finite and >= 0, got nan at stage 2"),
    ({"I_free": [1.0, 2.0]}, ValueError, r"memory\['I_free'\] must be a scalar or have one entry per stage \(4\)"),
    ({"F": [5, 5, 5, 5], "I_free": [0, 0, 6, 0]}, ValueError,
     r"memory\['I_free'\] \(6\) must not exceed memory\['F'\] \(5\) at stage 2"),
    ({"I_free": 2}, ValueError, r"must not exceed memory\['F'\] \(1\) at stage 0"),  # default F = 1
    ([("F", 1)], TypeError, "memory must be a mapping"),
])
def test_bad_memory(memory, error, pattern):
    with pytest.raises(error, match=pattern):
        pp.simulate(pp.build("zb1p", 4, 8), memory=memory)


def test_default_costs_are_the_documented_ones_and_a_non_schedule_is_refused():
    """simulate(s) is simulate(s, F=1, B=2, W=1) (the documented defaults, which the
    bubble formulas assume); an object with ops but no layout is a TypeError, not an
    AttributeError from deep inside (both found surviving by mutation testing)."""
    s = pp.build("zb1p", 4, 8)
    t, ref = pp.simulate(s), pp.simulate(s, F=1.0, B=2.0, W=1.0)
    assert t.makespan == ref.makespan and np.array_equal(t.bubble, ref.bubble)
    durations = {op.kind: e - b for op, b, e in zip(s.ops[0], t.starts[0], t.ends[0]) if hasattr(op, "kind")}
    assert durations == {"F": 1.0, "I": 1.0, "W": 1.0}          # I = B - W

    class OpsOnly:
        ops = s.ops
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        pp.simulate(OpsOnly())


def test_an_overlapped_forward_and_input_grad_pair_costs_FB_minus_W_or_FI():
    """A DualPipe pair whose backward is split (F & I, its W later) lasts FB - W of the
    backward's stage, or FI of its forward's stage when given (mutation testing found this
    path unrun by the simulator's tests)."""
    layout = pp.build("dualpipe", 2, 4).layout
    s = pp.Schedule.from_csv("0F0,3F2,0F1,3B2,(3F3;0I0)OVERLAP_F_B,0W0,3B3,0I1,0W1\n"
                             "2F2,1F0,2F3,1B0,(1F1;2B2)OVERLAP_F_B,1B1,2I3,2W3\n", layout=layout)
    for kw, want in (({}, 3.0 - 0.5), ({"FI": 1.7}, 1.7), ({"W": 2.0, "FB": 1.5}, 0.0)):
        t = pp.simulate(s, **{"F": 1.0, "B": 2.0, "W": 0.5, **kw})
        assert t.ends[0][4] - t.starts[0][4] == pytest.approx(want), kw


def test_a_full_backward_frees_one_unit_and_an_idle_rank_holds_nothing():
    """One stage on rank 0 running 0F0, 0B0, 0F1, 0F2, 0B1, 0B2 (rank 1 owns no stage and
    idles). Units: F +1, B -1 -> 1, 0, 1, 2, 1, 0: peak 2 (after a B, so a B that freed
    more would show); bytes with F=10: 20. The idle rank holds nothing and idles for the
    whole makespan (mutation testing found the B's unit and the empty rank unpinned)."""
    f, b = F, B
    ops = ((f(0, 0), b(0, 0), f(0, 1), f(0, 2), b(0, 1), b(0, 2)), ())
    s = pp.Schedule("idle", pp.Layout.chain((0,), 3, num_ranks=2), ops)
    t = pp.simulate(s, memory={"F": 10})
    assert t.peak_activations.tolist() == [2, 0]
    np.testing.assert_array_equal(t.peak_memory, [20.0, 0.0])
    assert t.bubble[1] == t.makespan


def test_a_zero_length_input_grad_frees_before_it_allocates():
    """One stage: 0F0, 0I0, 0W0 with B = W = 1, so I = B - W = 0 and the I starts and ends
    at t = 1. Memory F=10, I=3, I_free=4: frees before allocations at equal times gives
    0F0 +10=10 | t=1: I frees 4 -> 6, then allocates 3 -> 9 | 0W0 -(10+3-4) -> 0: peak 10
    (program order, allocation first, would give 13). Mutation testing found the time sort
    and its tie rule unpinned: ops on a rank never overlap, so only a zero-length op ties."""
    s = pp.Schedule("zero-I", pp.Layout.chain((0,), 1), ((F(0, 0), I(0, 0), W(0, 0)),))
    t = pp.simulate(s, F=1.0, B=1.0, W=1.0, memory={"F": 10, "I": 3, "I_free": 4})
    assert t.starts[0][1] == t.ends[0][1] == 1.0
    np.testing.assert_array_equal(t.peak_memory, [10.0])
    assert t.peak_activations.tolist() == [1]


def test_simulate_validates_by_default():
    """A schedule whose forward comes after its backward is refused by the validator (a
    ScheduleError naming the op) unless ``check=False`` (mutation testing found the default
    unpinned)."""
    bad = pp.Schedule("late-F", pp.Layout.chain((0,), 1), ((B(0, 0), F(0, 0)),))
    with pytest.raises(pp.ScheduleError):
        pp.simulate(bad)
