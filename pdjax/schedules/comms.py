"""Send/receive actions derived from a schedule's layout (never written by hand).

For every op, a cross-rank input becomes a ``RECV`` just before the op on the consumer
rank, and a cross-rank consumer of its output becomes a ``SEND`` just after it on the
producer rank. Names follow torch.distributed.pipelining: ``{stage}SEND_F{mb}``,
``{stage}RECV_F{mb}``, ``{stage}SEND_B{mb}``, ``{stage}RECV_B{mb}``, where ``stage`` is
the local stage. Stages next to each other on one rank (DualPipeV's turn) exchange
locally: no action.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops import BACKWARD_WEIGHT, FORWARD


@dataclass(frozen=True, slots=True)
class CommAction:
    """``kind`` in SEND_F/RECV_F/SEND_B/RECV_B for local ``stage`` and ``microbatch``,
    exchanged with rank ``peer``."""

    kind: str
    stage: int
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def derive_comms(schedule) -> list[list]:
    """Per rank, the ops interleaved with their derived :class:`CommAction` s."""
    layout = schedule.layout
    rank_of, prev_s, next_s = layout.stage_rank, layout.prev_stage, layout.next_stage
    out = []
    for r, ops in enumerate(schedule.ops):
        actions: list = []
        for op in ops:
            recvs, sends = [], []
            for part in op.parts:
                s, m = part.stage, part.microbatch
                if part.kind == FORWARD:
                    p, n = prev_s[s], next_s[s]
                    if p >= 0 and rank_of[p] != r:
                        recvs.append(CommAction("RECV_F", s, m, rank_of[p]))
                    if n >= 0 and rank_of[n] != r:
                        sends.append(CommAction("SEND_F", s, m, rank_of[n]))
                elif part.kind != BACKWARD_WEIGHT:
                    p, n = prev_s[s], next_s[s]
                    if n >= 0 and rank_of[n] != r:
                        recvs.append(CommAction("RECV_B", s, m, rank_of[n]))
                    if p >= 0 and rank_of[p] != r:
                        sends.append(CommAction("SEND_B", s, m, rank_of[p]))
            actions.extend(recvs)
            actions.append(op)
            actions.extend(sends)
        out.append(actions)
    return out


def comm_volume(schedule) -> list[dict]:
    """Per rank, the number of sends and receives of activations (F) and gradients (B)."""
    counts = []
    for actions in derive_comms(schedule):
        c = {"SEND_F": 0, "RECV_F": 0, "SEND_B": 0, "RECV_B": 0}
        for a in actions:
            if isinstance(a, CommAction):
                c[a.kind] += 1
        counts.append(c)
    return counts
