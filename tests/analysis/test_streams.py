"""The two-stream scheduler (pdjax.analysis.streams.schedule) and the overlap programs built
on it, against timelines worked out by hand."""

import pytest

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
    assert class_times(spans) == {"gemm": 2, "attention": 0, "dispatch": 3, "combine": 0, "other": 1}


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
