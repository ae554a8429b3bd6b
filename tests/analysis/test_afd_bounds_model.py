"""The AFD bounds of pdjax.analysis.afd_bounds are formulas from the literature and
consequences of the one overlap model: the AF ping-pong program
(pdjax.analysis.overlap.af_program) scheduled by pdjax.analysis.streams.schedule hides the
exchange exactly when they say so. Times are whole seconds, so every schedule is exact."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.analysis.afd_bounds import afd_min_microbatches, afd_min_microbatches_int, dbo_hides_ffn
from pdjax.analysis.overlap import AFStages, af_program
from pdjax.analysis.streams import busy_time, schedule


def _spans(stages, m, layers):
    return schedule(af_program([stages] * layers, m))


def _cycle(stages, m):
    """The steady-state layer time: the makespan's growth from 2 to 3 layers."""
    return max(s.end_s for s in _spans(stages, m, 3)) - max(s.end_s for s in _spans(stages, m, 2))


def _attention_never_waits(spans):
    att = [s for s in spans if s.stream == "attention"]
    return busy_time(att) == max(s.end_s for s in att) - min(s.start_s for s in att)


@st.composite
def _pingpong(draw):
    t_f = draw(st.integers(1, 12))
    return t_f, draw(st.integers(0, t_f)), draw(st.integers(1, 10))      # T_f, T_c <= T_f, m


@settings(max_examples=300, deadline=None)
@given(case=_pingpong())
def test_min_microbatches_is_where_the_schedule_hides_the_exchange(case):
    """T_a = T_f: a layer of m micro-batches takes m T_f in the schedule (the attention side
    never waits for the exchange) exactly when m >= 2 (1 + T_c / T_f); the integer bound is
    the smallest such m."""
    t_f, t_c, m = case
    stages = AFStages(attn=t_f, a2f=t_c, ffn=t_f, f2a=t_c)
    hidden = _cycle(stages, m) == m * t_f
    assert hidden == (m >= afd_min_microbatches(t_c, t_f))
    assert hidden == _attention_never_waits(_spans(stages, m, 3))
    smallest = next(k for k in range(1, 12) if _cycle(stages, k) == k * t_f)
    assert smallest == afd_min_microbatches_int(t_c, t_f)


@settings(max_examples=300, deadline=None)
@given(t_a=st.integers(1, 12), t_f=st.integers(0, 12), a2f=st.integers(0, 6), f2a=st.integers(0, 6))
def test_dbo_hides_ffn_is_where_two_micro_batches_keep_attention_busy(t_a, t_f, a2f, f2a):
    """Two micro-batches: micro-batch 1's A2F, FFN and F2A fit under micro-batch 2's attention
    (the attention side never waits, a layer takes 2 T_a) exactly when
    dbo_hides_ffn(T_a, T_f, A2F + F2A): T_comm is the exchange's round trip."""
    stages = AFStages(attn=t_a, a2f=a2f, ffn=t_f, f2a=f2a)
    hides = dbo_hides_ffn(t_a, t_f, a2f + f2a)
    assert _attention_never_waits(_spans(stages, 2, 3)) == hides
    assert (_cycle(stages, 2) == 2 * t_a) == hides
