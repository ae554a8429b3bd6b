"""Schedule validator: ownership, counts, per-rank order, deadlock-freedom.

Every error is a ValueError naming the rank, the op's position on that rank and the op
(in torch's text form), so a broken CSV or generator is easy to locate.
"""

from __future__ import annotations

from .engine import compile_program, run_program
from .ops import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message names the rank and op."""


def validate(schedule) -> None:
    """Raise :class:`ScheduleError` at the first broken rule, in this order:

    1. each op names an existing stage owned by its rank and a micro-batch of that
       stage's pipeline;
    2. per rank, each (stage, micro-batch) has one forward, then one backward (a full
       ``B``, or an ``I`` then a ``W``); a backward never precedes its forward, a ``W``
       never precedes its ``I``; an overlapped pair may not contain its own dependency;
    3. every (stage, micro-batch) of every pipeline gets its forward and backward;
    4. the sends/receives derived from the layout can make progress (no deadlock).
    """
    layout = schedule.layout
    num_stages = layout.num_stages
    stride = max(schedule.max_microbatch + 1, layout.num_microbatches, 1)
    fwd_done: set[int] = set()
    grad_done: set[int] = set()
    split: set[int] = set()  # (stage, mb) whose backward was split into I (+W)
    w_done: set[int] = set()
    for r, ops in enumerate(schedule.ops):
        for i, op in enumerate(ops):
            where = f"rank {r} op #{i} {op}"
            pending: list[tuple[str, int]] = []
            for part in op.parts:
                s, m = part.stage, part.microbatch
                if s >= num_stages:
                    raise ScheduleError(f"{where}: stage {s} does not exist (the layout has {num_stages} stages)")
                owner = layout.stage_rank[s]
                if owner != r:
                    raise ScheduleError(f"{where}: stage {s} belongs to rank {owner}, not rank {r}")
                if not layout.stage_has_microbatch(s, m):
                    mbs = layout.pipeline_of_stage(s).microbatches
                    raise ScheduleError(
                        f"{where}: micro-batch {m} is not in stage {s}'s pipeline "
                        f"(micro-batches {mbs.start}..{mbs.stop - 1})"
                    )
                key = s * stride + m
                kind = part.kind
                if kind == FORWARD:
                    if key in fwd_done:
                        raise ScheduleError(f"{where}: second forward of stage {s} micro-batch {m}")
                elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
                    if key not in fwd_done:
                        raise ScheduleError(
                            f"{where}: backward of stage {s} micro-batch {m} comes before its forward {s}F{m}"
                        )
                    if key in grad_done:
                        raise ScheduleError(f"{where}: second backward of stage {s} micro-batch {m}")
                elif kind == BACKWARD_WEIGHT:
                    if key not in split:
                        if key in grad_done:
                            raise ScheduleError(
                                f"{where}: stage {s} micro-batch {m} already ran a full backward {s}B{m}; "
                                f"W is only for an I/W split"
                            )
                        raise ScheduleError(f"{where}: W comes before its input-grad backward {s}I{m}")
                    if key in w_done:
                        raise ScheduleError(f"{where}: second W of stage {s} micro-batch {m}")
                pending.append((kind, key))
            # a pair's results only exist once the whole pair has run
            for kind, key in pending:
                if kind == FORWARD:
                    fwd_done.add(key)
                elif kind == BACKWARD_WEIGHT:
                    w_done.add(key)
                else:
                    grad_done.add(key)
                    if kind == BACKWARD_INPUT:
                        split.add(key)
    _check_counts(schedule, stride, fwd_done, grad_done, split, w_done)
    run_program(schedule, compile_program(schedule),
                [[0.0] * len(ops) for ops in schedule.ops], [0.0] * num_stages)


def _check_counts(schedule, stride, fwd_done, grad_done, split, w_done) -> None:
    layout = schedule.layout
    for pipe in layout.pipelines:
        for s in pipe.stages:
            r = layout.stage_rank[s]
            for m in pipe.microbatches:
                key = s * stride + m
                if key not in fwd_done:
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} has no forward (expected op {s}F{m})")
                if key not in grad_done:
                    raise ScheduleError(
                        f"rank {r}: stage {s} micro-batch {m} has no backward (expected op {s}B{m} or {s}I{m})"
                    )
                if key in split and key not in w_done:
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} has {s}I{m} but no {s}W{m}")
