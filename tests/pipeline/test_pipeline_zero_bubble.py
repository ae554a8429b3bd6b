"""ZB-H2, ZB-V, V-Half, V-Min: valid schedules, and the zero-bubble papers' claims computed
from the inputs (P, m, F, I, W) and checked with the simulator, or the simulator saying
where a claim does not hold."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp
from pdjax.schedules.greedy import span_bubble
from pdjax.schedules.vblock import building_block

NEW = ["zbh2", "zbv", "v-half", "v-min"]


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(NEW), p=st.integers(1, 8), m=st.integers(1, 24))
def test_new_generators_validate_and_cover(name, p, m):
    s = pp.build(name, p, m)
    s.validate()
    assert s.num_ranks == p and s.num_microbatches == m
    for pipe in s.layout.pipelines:
        for stage in pipe.stages:
            parts = [q for op in s.ops[s.layout.stage_rank[stage]] for q in op.parts if q.stage == stage]
            for kind in "FIW":
                assert sorted(q.microbatch for q in parts if q.kind == kind) == list(pipe.microbatches)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (6, 16)])
def test_zbh1_bubble_at_1f1b_memory(p, m):
    """ZB-H1 (zb1p): bubble (P-1)(F+B-2W) with 1F1B's memory P, when W <= min(F, I)."""
    F, B, W = 1.0, 2.0, 0.75   # I = 1.25 >= W, F >= W
    t = pp.simulate(pp.build("zb1p", p, m), F=F, B=B, W=W)
    t1 = pp.simulate(pp.build("1f1b", p, m), F=F, B=B, W=W)
    assert np.isclose(t.bubble.max(), (p - 1) * (F + B - 2 * W))
    assert t.peak_activations.max() == t1.peak_activations.max() == p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbh2_zero_bubble_at_twice_the_memory(p, m):
    """ZB-H2 with F = I = W: every rank busy from its first op to its last (the steady
    state tiles with no bubble), makespan m(F+B) + (P-1)F, peak 2P-1 <= 2x 1F1B's P."""
    F = I = W = 1.0
    t = pp.simulate(pp.build("zbh2", p, m), F=F, B=I + W, W=W)
    assert np.allclose(span_bubble(t), 0.0)
    assert np.isclose(t.makespan, m * (F + I + W) + (p - 1) * F)
    assert t.peak_activations.max() <= 2 * p - 1 <= 2 * pp.memory_table("1f1b", p)["activations"]


@pytest.mark.parametrize("costs", [dict(F=1.0, B=2.0, W=1.0, comm=0.5), dict(F=1.0, B=4.0, W=1.0)])
def test_zbh2_simulator_says_when_the_claim_fails(costs):
    """Outside F = I = W without comm (a link latency; I = 3F) the same op order idles."""
    t = pp.simulate(pp.build("zbh2", 4, 8), **costs)
    assert span_bubble(t).max() > 0


@pytest.mark.parametrize("p,m", [(2, 3), (4, 7), (4, 16), (5, 12), (8, 32)])
def test_zbv_zero_bubble_at_1f1b_memory(p, m):
    """ZB-V with F = I = W (per rank; a V stage costs half) and m >= 2P - 1: every rank busy
    from its first op to its last, makespan m(F+I+W) + (P-1)F/2 (rank r starts at r half
    forwards and runs its 6m half ops back to back), peak 2P half-stage activations =
    P rank units = 1F1B's peak."""
    F = I = W = 1.0
    t = pp.simulate(pp.build("zbv", p, m), F=F / 2, B=(I + W) / 2, W=W / 2)
    t1 = pp.simulate(pp.build("1f1b", p, m), F=F, B=I + W, W=W)
    assert np.allclose(span_bubble(t), 0.0)
    starts = np.array([s.min() for s in t.starts])
    assert np.allclose(starts, np.arange(p) * F / 2)
    assert np.isclose(t.makespan, m * (F + I + W) + (p - 1) * F / 2)
    assert t.peak_activations.max() / 2 == t1.peak_activations.max() == p


@pytest.mark.parametrize("p,m,costs", [
    (4, 5, dict(F=0.5, B=1.0, W=0.5)),              # m < 2P - 1: not enough micro-batches
    (4, 16, dict(F=0.5, B=1.0, W=0.5, comm=0.1)),   # a link latency
    (4, 16, dict(F=0.5, B=1.5, W=0.5)),             # I = 2F
])
def test_zbv_simulator_says_when_the_claim_fails(p, m, costs):
    t = pp.simulate(pp.build("zbv", p, m), **costs)
    assert span_bubble(t).max() > 1e-9


# V-Half and V-Min (controllable-memory paper, arXiv 2405.15362). Costs per V stage
# (half a rank's layers): with f = i = w = 1 one op is one slot of the building block.
PAPER_PEAK = {"v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3}   # rank units
PAPER_BUBBLE = {"v-half": 1 / 2, "v-min": 2 / 3}   # of 1F1B's bubble, F = I = W


def _sim(s, f=1.0, i=1.0, w=1.0):
    return pp.simulate(s, F=f, B=i + w, W=w)


def _bubble_1f1b(p, m, f=1.0, i=1.0, w=1.0):
    """1F1B's idle time per rank with the same layers per rank (a rank = two V stages),
    simulated, and checked against its closed form (P-1)(F+B)."""
    t = pp.simulate(pp.build("1f1b", p, m), F=2 * f, B=2 * (i + w), W=2 * w)
    assert np.isclose(t.makespan - m * 2 * (f + i + w), (p - 1) * 2 * (f + i + w))
    return t.makespan - m * 2 * (f + i + w)


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_v_building_block_is_collision_free_and_its_steady_state_has_no_bubble(name, p):
    """Each rank's four F/I slots of micro-batch 0 differ mod the interval 6, so repeating
    the block never puts two ops on one slot; the W's fill the other two. Then every extra
    micro-batch adds its 6 ops and no idle time: the makespan grows by exactly 6 slots."""
    block, gaps = building_block(p, name)
    assert set(block) == {(k, s) for k in "FI" for s in range(2 * p)}
    for r in range(p):
        assert len({block[(k, s)] % 6 for k in "FI" for s in (r, 2 * p - 1 - r)}) == 4
    m0 = 2 * p
    spans = [_sim(pp.build(name, p, m)).makespan for m in (m0, m0 + 1, m0 + 5)]
    assert np.allclose(np.diff(spans), [6.0, 24.0])


def _alive_peak(t, p, j):
    """The paper's lemma, exact form: in the steady state a stage's activation lives
    l = W end - F start slots and a new one starts every 6, so at time x the rank holds
    floor((x - F)/6) - floor((x - F - l)/6) of them; the rank's peak is the max over one
    interval of the sum over its two stages (each term at most ceil(l/6))."""
    when = {(e.op.kind, e.op.stage): (e.start, e.end) for e in t.events if e.op.microbatch == j}
    best = 0
    for r in range(p):
        life = [(when[("F", s)][0], when[("W", s)][1] - when[("F", s)][0]) for s in (r, 2 * p - 1 - r)]
        assert all(float(l).is_integer() for _, l in life)
        x0 = max(f + l for f, l in life)
        held = [sum(math.floor((x - f) / 6) - math.floor((x - f - l) / 6) for f, l in life)
                for x in np.arange(x0, x0 + 6)]
        assert max(held) <= sum(math.ceil(l / 6) for _, l in life)
        best = max(best, max(held))
    return best


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
def test_v_peak_memory_is_the_papers(name, p):
    """Peak = the paper's (P+2)//2 (V-Half) and (P+4)//3 (V-Min) micro-batches of a rank's
    layers (a V stage holds half) for m >= that peak, = the block lifespans' count; 1F1B
    holds P. With fewer micro-batches the rank holds all m (the claim's condition fails)."""
    want = PAPER_PEAK[name](p)
    m = 4 * p + 4
    t = _sim(pp.build(name, p, m))
    assert t.peak_activations.max() == 2 * want == _alive_peak(t, p, m // 2)
    assert want <= (p / 2 + 1 if name == "v-half" else p / 3 + 4 / 3)
    assert pp.simulate(pp.build("1f1b", p, m)).peak_activations.max() == p
    for m in range(1, want + 1):
        assert _sim(pp.build(name, p, m)).peak_activations.max() == 2 * m


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_v_bubble_against_1f1b(name, p):
    """F = I = W: bubble (makespan minus each rank's 6m busy slots) at most 1/2 (V-Half)
    and 2/3 (V-Min) of 1F1B's (P-1)(F+B), for m >= the peak. With one micro-batch the
    makespan is its chain, 2P forwards, 2P input-grads and a W: 4P + 1 slots, so V-Half's
    bubble 4P - 5 is above half of 1F1B's 6(P-1) once P > 2 (the claim needs m)."""
    frac, need = PAPER_BUBBLE[name], PAPER_PEAK[name](p)
    for m in (need, 4 * p):
        t = _sim(pp.build(name, p, m))
        assert np.allclose(t.busy, 6 * m)
        assert t.makespan - 6 * m <= frac * _bubble_1f1b(p, m) + 1e-9
    t = _sim(pp.build(name, p, 1))
    assert t.makespan == 4 * p + 1
    if name == "v-half":
        assert (t.makespan - 6 > frac * _bubble_1f1b(p, 1)) == (p > 2)


@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1.5, 1, 1), (0.5, 1, 1), (1, 1, 2), (1, 0.5, 1),
                                   (2, 1, 1), (1, 1.5, 0.5), (1, 2, 1), (1, 3, 0.5)])
def test_v_half_steady_state_condition(f, i, w):
    """The paper's condition for V-Half without a growing bubble, W + 2B >= 2F and
    W + 2F >= 2B (its B is our I): when it holds, more micro-batches add no idle time;
    when it fails the simulator shows the bubble growing with m."""
    holds = w + 2 * i >= 2 * f and w + 2 * f >= 2 * i
    for p in (4, 5):
        bub = [_sim(pp.build("v-half", p, m), f, i, w).makespan - m * 2 * (f + i + w) for m in (3 * p, 6 * p)]
        assert np.isclose(bub[0], bub[1]) == holds, (p, bub)


@pytest.mark.parametrize("f,i,w,grows", [(1, 1, 1, False), (1.5, 1, 1, True), (1, 2, 1, True)])
def test_v_min_degrades_when_unbalanced(f, i, w, grows):
    """V-Min (and, at 1.5:1:1, only V-Min) loses its steady state when F, B, W are not
    balanced: its bubble grows with m (the repository README's 'O(n) overhead')."""
    for p in (4, 8):
        bub = [_sim(pp.build("v-min", p, m), f, i, w).makespan - m * 2 * (f + i + w) for m in (2 * p, 4 * p)]
        assert (bub[1] > bub[0] + 1e-9) == grows
