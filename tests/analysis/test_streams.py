"""The scheduler (pdjax.analysis.streams.schedule) and the overlap programs built
on it, against timelines worked out by hand."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.analysis.opmodel import LayerParts, Part
from pdjax.analysis.overlap import layer_program, run
from pdjax.analysis.streams import Op, Span, busy_time, class_times, makespan, schedule


def _ends(spans):
    return {s.label: (s.start_s, s.end_s) for s in spans}


def test_ops_wait_for_their_stream_and_their_inputs():
    ops = [Op("a", "compute", "attention", 1.0), Op("d", "comm", "dispatch", 2.0, after=("a",)),
           Op("b", "compute", "gemm", 1.0), Op("m", "compute", "gemm", 1.0, after=("d",))]
    assert _ends(schedule(ops)) == {"a": (0, 1), "d": (1, 3), "b": (1, 2), "m": (3, 4)}


def test_sm_holding_comm_slows_only_the_gemms_beside_it():
    """b (a GEMM) runs 1 s of work beside d for 2 s at half speed; o (other) is not slowed."""
    ops = [Op("d", "comm", "dispatch", 2.0, holds_sms=True), Op("b", "compute", "gemm", 2.0),
           Op("o", "compute", "other", 1.0)]
    got = _ends(schedule(ops, compute_slowdown=2.0))
    assert got["b"] == (0, pytest.approx(3.0)) and got["o"] == (pytest.approx(3.0), pytest.approx(4.0))
    free = _ends(schedule([dataclass_replace(ops[0], holds_sms=False)] + ops[1:], compute_slowdown=2.0))
    assert free["b"] == (0, 2.0)


def dataclass_replace(op, **kw):
    import dataclasses
    return dataclasses.replace(op, **kw)


def test_bad_programs_are_refused():
    with pytest.raises(ValueError, match="waits for 'x', which is not an earlier op"):
        schedule([Op("a", "compute", "gemm", 1.0, after=("x",))])
    with pytest.raises(ValueError, match="appears twice"):
        schedule([Op("a", "compute", "gemm", 1.0), Op("a", "comm", "dispatch", 1.0)])
    with pytest.raises(ValueError, match="stream must be one of"):
        Op("a", "copy", "gemm", 1.0)
    with pytest.raises(ValueError, match="op_class must be one of"):
        Span("compute", "matmul", 0, 1)


def test_span_helpers():
    spans = [Span("compute", "gemm", 0, 2), Span("comm", "dispatch", 1, 4), Span("compute", "other", 5, 6)]
    assert makespan(spans) == 6 and busy_time(spans) == 5
    assert class_times(spans) == {"gemm": 2, "attention": 0, "indexer": 0, "dispatch": 3, "combine": 0, "other": 1}


def test_two_batch_overlap_hides_the_all_to_all():
    """Per layer compute C = attention 2 + experts 2 per micro-batch, all-to-all 1 + 1: with two
    micro-batches the comm of one runs under the other's compute, so L layers take L * 2 * C
    plus the last combine (the first dispatch runs under the second attention); one
    micro-batch serialises everything."""
    lp = LayerParts(Part(attention=2.0), Part(), Part(gemm=2.0), Part(comm=1.0), Part(comm=1.0))
    L = 6
    one = makespan(run(layer_program([lp] * L, 1, comm_holds_sms=False)))
    two = makespan(run(layer_program([lp] * L, 2, comm_holds_sms=False)))
    assert one == pytest.approx(L * (2 + 1 + 2 + 1))
    assert two == pytest.approx(L * 2 * 4 + 1)


# ---- any named streams (RESOURCES) --------------------------------------------------------

def test_every_resource_is_a_stream_of_its_own():
    """The AF streams run beside each other and beside the GPU pair; each runs one op at a time."""
    from pdjax.analysis.streams import AFD_STREAMS, RESOURCES, STREAMS
    assert RESOURCES == STREAMS + AFD_STREAMS == ("compute", "comm", "attention", "a2f", "ffn", "f2a")
    ops = [Op(f"{s}{k}", s, "other", 1.0) for s in RESOURCES for k in range(2)]
    got = _ends(schedule(ops))
    assert got == {f"{s}{k}": (k, k + 1) for s in RESOURCES for k in range(2)}


def test_ops_on_named_streams_wait_for_their_inputs():
    ops = [Op("a0", "attention", "attention", 1.0), Op("x0", "a2f", "dispatch", 0.5, after=("a0",)),
           Op("a1", "attention", "attention", 1.0), Op("x1", "a2f", "dispatch", 2.0, after=("a1",)),
           Op("f0", "ffn", "gemm", 1.0, after=("x0",)), Op("f1", "ffn", "gemm", 1.0, after=("x1",)),
           Op("y0", "f2a", "combine", 0.5, after=("f0",))]
    assert _ends(schedule(ops)) == {"a0": (0, 1), "x0": (1, 1.5), "a1": (1, 2), "x1": (2, 4), "f0": (1.5, 2.5),
                                    "f1": (4, 5), "y0": (2.5, 3)}


def test_only_the_compute_streams_gemms_are_slowed_by_an_sm_holding_op():
    """An SM-holding op on any other stream (here "a2f") slows a GEMM on "compute"; a GEMM on
    "ffn" (another device) is not slowed, whatever holds SMs beside it."""
    ops = [Op("x", "a2f", "dispatch", 2.0, holds_sms=True), Op("g", "compute", "gemm", 2.0),
           Op("f", "ffn", "gemm", 2.0)]
    got = _ends(schedule(ops, compute_slowdown=2.0))
    assert got["g"] == (0, pytest.approx(3.0)) and got["f"] == (0, 2.0)


def test_an_op_of_no_duration_frees_a_stream_looked_at_before_it():
    """d (0 s, on comm) ends at once at t = 1 and frees e on compute, which starts at 1 too,
    although compute comes before comm in RESOURCES and another op is still running."""
    ops = [Op("a", "compute", "attention", 1.0), Op("d", "comm", "dispatch", 0.0, after=("a",)),
           Op("e", "compute", "gemm", 1.0, after=("d",)), Op("z", "ffn", "gemm", 5.0)]
    assert _ends(schedule(ops)) == {"a": (0, 1), "d": (1, 1), "e": (1, 2), "z": (0, 5)}


def _reference(ops):
    """Each op's (start, end) by the recurrence the scheduler's rules give without slowdown:
    in program order, start = max(its stream free, its inputs' ends)."""
    free, out = {}, {}
    for op in ops:
        start = max([free.get(op.stream, 0.0)] + [out[d][1] for d in op.after])
        out[op.name] = (start, start + op.duration_s)
        free[op.stream] = start + op.duration_s
    return out


@st.composite
def _programs(draw):
    from pdjax.analysis.streams import RESOURCES
    n = draw(st.integers(1, 14))
    ops = []
    for i in range(n):
        after = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        ops.append(Op(f"o{i}", draw(st.sampled_from(RESOURCES)), "other",
                      draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 3.0])), tuple(f"o{j}" for j in after)))
    return ops


@settings(max_examples=200, deadline=None)
@given(ops=_programs())
def test_any_program_on_any_streams_follows_the_rules(ops):
    """Random programs over all of RESOURCES (times in 1/4 s, exact in binary): the timeline is
    the in-order recurrence, and no two ops of a stream overlap."""
    got = _ends(schedule(ops))
    assert got == _reference(ops)
    for s in {op.stream for op in ops}:
        spans = sorted((got[op.name] for op in ops if op.stream == s and op.duration_s > 0))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
