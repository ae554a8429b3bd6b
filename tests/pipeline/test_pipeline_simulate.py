"""Timed simulator against closed forms derived independently of it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.pipeline as pp

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
    (dict(F=-1.0), "F must be finite and >= 0"),
    (dict(B=[1.0, 2.0]), "one entry per stage"),
    (dict(B=1.0, W=2.0), r"W \(2\) must not exceed B \(1\)"),
    (dict(comm=float("nan")), "comm must be finite"),
])
def test_bad_costs(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        pp.simulate(pp.build("1f1b", 4, 8), **kwargs)


def test_simulate_reports_deadlock_without_validation():
    s = pp.build("1f1b", 2, 2)
    f, b = pp.F, pp.B
    ops = ((f(0, 0), b(0, 0), f(0, 1), b(0, 1)), (f(1, 0), f(1, 1), b(1, 0), b(1, 1)))
    bad = pp.Schedule("t", s.layout, ops)
    with pytest.raises(pp.DeadlockError):
        pp.simulate(bad, check=False)
