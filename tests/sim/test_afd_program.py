"""The AF ping-pong step model is the one overlap model: pdjax.sim.afd_step.afd_program is a
program for pdjax.analysis.streams.schedule, and the closed form the simulator's event loop
uses, afd_layer_cycle = max(m T_a, m T_f, m T_c, T_a + T_f + 2 T_c), is that program's
steady-state layer time."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.analysis.streams import AFD_STREAMS, busy_time, schedule
from pdjax.sim.afd_step import afd_layer_cycle, afd_program, afd_scheduled_cycle, exchange_hidden

times = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)


def _makespan(t_a, t_f, t_c, m, layers, t_back=None):
    return max(s.end_s for s in schedule(afd_program(t_a, t_f, t_c, m, layers, t_back=t_back)))


def test_program_by_hand():
    """m = 2, T_a = 1, T_f = 2, T_c = 1: the round trip (5) sets the cycle; the FFN side waits."""
    spans = {s.label: (s.start_s, s.end_s) for s in schedule(afd_program(1.0, 2.0, 1.0, 2, 2))}
    assert {s.stream for s in schedule(afd_program(1.0, 2.0, 1.0, 2, 2))} == set(AFD_STREAMS)
    assert spans["a0.0"] == (0, 1) and spans["a0.1"] == (1, 2) and spans["x0.1"] == (2, 3)
    assert spans["f0.0"] == (2, 4) and spans["f0.1"] == (4, 6) and spans["y0.0"] == (4, 5)
    assert spans["a1.0"] == (5, 6) and spans["a1.1"] == (7, 8)        # each after its own round trip
    assert _makespan(1.0, 2.0, 1.0, 2, 3) - _makespan(1.0, 2.0, 1.0, 2, 2) == 5 == afd_layer_cycle(1.0, 2.0, 1.0, 2)


@settings(max_examples=300, deadline=None)
@given(t_a=times, t_f=times, t_c=times, m=st.integers(1, 8))
def test_closed_form_is_the_scheduled_steady_state(t_a, t_f, t_c, m):
    """Per layer the makespan grows by the same cycle from the first layer on (the ping-pong is
    in its steady state at once); that cycle is the closed form, the links (m T_c, one
    micro-batch at a time) included."""
    ends = [_makespan(t_a, t_f, t_c, m, n) for n in range(1, 7)]
    cycle = afd_scheduled_cycle(t_a, t_f, t_c, m)
    tol = 1e-9 * max(1.0, ends[-1])
    assert all(b - a == pytest.approx(cycle, abs=tol) for a, b in zip(ends, ends[1:]))
    closed = afd_layer_cycle(t_a, t_f, t_c, m)
    assert cycle == pytest.approx(closed, abs=tol)
    compute_bound = m * max(t_a, t_f)
    if closed == compute_bound or abs(closed - compute_bound) > tol:     # off the boundary's float dust
        assert exchange_hidden(t_a, t_f, t_c, m) == (cycle <= compute_bound + tol)


@settings(max_examples=100, deadline=None)
@given(t_a=times, t_f=times, t_c=times, t_b=times, m=st.integers(1, 6))
def test_each_direction_is_its_own_link(t_a, t_f, t_c, t_b, m):
    """A2F and F2A times apart: the round trip holds both, each link serves m micro-batches."""
    cycle = afd_scheduled_cycle(t_a, t_f, t_c, m, t_back=t_b)
    expect = max(m * t_a, m * t_f, m * t_c, m * t_b, t_a + t_f + t_c + t_b)
    assert cycle == pytest.approx(expect, abs=1e-9 * max(1.0, expect))


def test_the_links_bind_when_they_carry_the_most():
    """T_a = T_f = 1, T_c = 2.5, m = 3: each link carries 3 x 2.5 = 7.5 s a layer, more than the
    round trip (7): the schedule and the closed form both say 7.5 (an earlier closed form
    without the m T_c term said 7)."""
    assert afd_layer_cycle(1.0, 1.0, 2.5, 3) == 7.5
    assert afd_scheduled_cycle(1.0, 1.0, 2.5, 3) == pytest.approx(7.5)
    link = [s for s in schedule(afd_program(1.0, 1.0, 2.5, 3, 4)) if s.stream == "a2f"]
    assert busy_time(link) == pytest.approx(max(s.end_s for s in link) - min(s.start_s for s in link))


def test_program_refuses_bad_input():
    with pytest.raises(ValueError, match="microbatches"):
        afd_program(1.0, 1.0, 1.0, 0, 2)
    with pytest.raises(ValueError, match="layers"):
        afd_program(1.0, 1.0, 1.0, 2, 0)
    with pytest.raises(ValueError, match="t_back"):
        afd_program(1.0, 1.0, 1.0, 2, 2, t_back=-1.0)
