"""Schedule validator: ownership, counts, per-rank order, deadlock-freedom.

Every error is a ValueError naming the rank, the op's position on that rank and the op
(in torch's text form), so a broken CSV or generator is easy to locate.
"""

from __future__ import annotations

from .program import compile_program, run_program
from .ops import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Op


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank and op."""


_FWD, _GRAD, _SPLIT, _WDONE = 1, 2, 4, 8  # per (stage, micro-batch) state bits


def validate(schedule) -> None:
    """Raise :class:`ScheduleError` at the first broken rule, in this order:

    1. each op names an existing stage owned by its rank and a micro-batch of that
       stage's pipeline;
    2. per rank, each (stage, micro-batch) has one forward, then one backward (a full
       ``B``, or an ``I`` then a ``W``); a backward never precedes its forward, a ``W``
       never precedes its ``I``; an overlapped pair may not contain its own dependency;
    3. every (stage, micro-batch) of every pipeline gets its forward and backward;
    4. the sends/receives derived from the layout can make progress (no deadlock).

    Linear in the number of ops: one byte of state per (stage, micro-batch), and no
    objects are created per op unless an error is reported.
    """
    layout = schedule.layout
    num_stages = layout.num_stages
    stage_rank = layout.stage_rank
    mb_lo = [layout.pipeline_of_stage(s).first_microbatch for s in range(num_stages)]
    mb_hi = [lo + layout.pipeline_of_stage(s).num_microbatches for s, lo in enumerate(mb_lo)]
    # every accepted micro-batch id is below every pipeline's end, so keys stay dense
    stride = max(max(mb_hi), 1)
    state = bytearray(num_stages * stride)
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            if type(op) is Op:
                _check_part(op, r, i, op, num_stages, stage_rank, mb_lo, mb_hi, stride, state, layout)
                _commit(op, stride, state)
            else:
                # a pair's results only exist once the whole pair has run
                for part in op.parts:
                    _check_part(part, r, i, op, num_stages, stage_rank, mb_lo, mb_hi, stride, state, layout)
                for part in op.parts:
                    _commit(part, stride, state)
    _check_counts(schedule, stride, state)
    run_program(schedule, compile_program(schedule),
                [[0.0] * len(ops) for ops in schedule.ops], [0.0] * num_stages)


def _where(r: int, i: int, op) -> str:
    return f"rank {r} op #{i} {op}"


def _check_part(part, r, i, op, num_stages, stage_rank, mb_lo, mb_hi, stride, state, layout) -> None:
    s, m = part.stage, part.microbatch
    if s >= num_stages:
        raise ScheduleError(f"{_where(r, i, op)}: stage {s} does not exist (the layout has {num_stages} stages)")
    owner = stage_rank[s]
    if owner != r:
        raise ScheduleError(f"{_where(r, i, op)}: stage {s} belongs to rank {owner}, not rank {r}")
    if not mb_lo[s] <= m < mb_hi[s]:
        mbs = layout.pipeline_of_stage(s).microbatches
        raise ScheduleError(
            f"{_where(r, i, op)}: micro-batch {m} is not in stage {s}'s pipeline "
            f"(micro-batches {mbs.start}..{mbs.stop - 1})"
        )
    st = state[s * stride + m]
    kind = part.kind
    if kind == FORWARD:
        if st & _FWD:
            raise ScheduleError(f"{_where(r, i, op)}: second forward of stage {s} micro-batch {m}")
    elif kind == FULL_BACKWARD or kind == BACKWARD_INPUT:
        if not st & _FWD:
            raise ScheduleError(
                f"{_where(r, i, op)}: backward of stage {s} micro-batch {m} comes before its forward {s}F{m}"
            )
        if st & _GRAD:
            raise ScheduleError(f"{_where(r, i, op)}: second backward of stage {s} micro-batch {m}")
    elif kind == BACKWARD_WEIGHT:
        if not st & _SPLIT:
            if st & _GRAD:
                raise ScheduleError(
                    f"{_where(r, i, op)}: stage {s} micro-batch {m} already ran a full backward {s}B{m}; "
                    f"W is only for an I/W split"
                )
            raise ScheduleError(f"{_where(r, i, op)}: W comes before its input-grad backward {s}I{m}")
        if st & _WDONE:
            raise ScheduleError(f"{_where(r, i, op)}: second W of stage {s} micro-batch {m}")


def _commit(part, stride, state) -> None:
    key = part.stage * stride + part.microbatch
    kind = part.kind
    if kind == FORWARD:
        state[key] |= _FWD
    elif kind == BACKWARD_WEIGHT:
        state[key] |= _WDONE
    elif kind == BACKWARD_INPUT:
        state[key] |= _GRAD | _SPLIT
    else:
        state[key] |= _GRAD


def _check_counts(schedule, stride, state) -> None:
    layout = schedule.layout
    for pipe in layout.pipelines:
        for s in pipe.stages:
            r = layout.stage_rank[s]
            for m in pipe.microbatches:
                st = state[s * stride + m]
                if not st & _FWD:
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} has no forward (expected op {s}F{m})")
                if not st & _GRAD:
                    raise ScheduleError(
                        f"rank {r}: stage {s} micro-batch {m} has no backward (expected op {s}B{m} or {s}I{m})"
                    )
                if st & _SPLIT and not st & _WDONE:
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} has {s}I{m} but no {s}W{m}")
