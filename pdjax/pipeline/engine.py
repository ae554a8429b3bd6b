"""Dependency compilation and the as-soon-as-possible progress engine.

Shared by the validator (zero durations: can every rank make progress?) and the timed
simulator (each op starts when its rank is free and its inputs have arrived).

Dependencies are derived from the layout, never written by hand:

- ``F(s, m)`` needs the activation of ``F(prev(s), m)``;
- ``B/I(s, m)`` needs ``F(s, m)`` (same rank) and the gradient from ``B/I(next(s), m)``;
- ``W(s, m)`` needs ``I(s, m)`` (same rank);
- a pair ``F&B`` needs the union of its parts' inputs and provides both results at its end.

A dependency between stages on different ranks is a send/recv and pays ``comm``;
sends are asynchronous (a producer never waits for its consumer).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ops import BACKWARD_WEIGHT, FORWARD

ACT, GRAD = 0, 1  # key kinds: forward activation ready, input gradient ready
_KEY_NAMES = {ACT: "forward", GRAD: "input-grad backward"}


@dataclass(frozen=True)
class Program:
    """Per rank: ops compiled to ``(requirements, provisions)`` integer keys.

    ``reqs[r][i]`` is a tuple of ``(key, cross_rank, producer_stage)``;
    ``provs[r][i]`` a tuple of keys. Keys encode ``(kind, stage, microbatch)``.
    """

    reqs: tuple[tuple[tuple[tuple[int, bool, int], ...], ...], ...]
    provs: tuple[tuple[tuple[int, ...], ...], ...]
    num_stages: int
    num_keys_per_kind: int
    key_stride: int

    def decode(self, key: int) -> tuple[int, int, int]:
        """``key -> (kind, stage, microbatch)``."""
        kind, rest = divmod(key, self.num_keys_per_kind)
        stage, mb = divmod(rest, self.key_stride)
        return kind, stage, mb


class DeadlockError(ValueError):
    """No rank can make progress: a cycle through the derived sends/receives."""


def compile_program(schedule) -> Program:
    """Compile a schedule's ops to integer dependency keys (see module docstring)."""
    layout = schedule.layout
    num_stages = layout.num_stages
    stride = max(schedule.max_microbatch + 1, layout.num_microbatches, 1)
    per_kind = num_stages * stride
    stage_rank, prev_stage, next_stage = layout.stage_rank, layout.prev_stage, layout.next_stage
    all_reqs, all_provs = [], []
    for ops in schedule.ops:
        rank_reqs, rank_provs = [], []
        for op in ops:
            reqs: list[tuple[int, bool, int]] = []
            provs: list[int] = []
            for part in op.parts:
                s, m = part.stage, part.microbatch
                base = s * stride + m
                if part.kind == FORWARD:
                    p = prev_stage[s]
                    if p >= 0:
                        reqs.append((p * stride + m, stage_rank[p] != stage_rank[s], p))
                    provs.append(base)
                elif part.kind == BACKWARD_WEIGHT:
                    reqs.append((per_kind + base, False, s))
                else:  # B or I
                    reqs.append((base, False, s))
                    n = next_stage[s]
                    if n >= 0:
                        reqs.append((per_kind + n * stride + m, stage_rank[n] != stage_rank[s], n))
                    provs.append(per_kind + base)
            rank_reqs.append(tuple(reqs))
            rank_provs.append(tuple(provs))
        all_reqs.append(tuple(rank_reqs))
        all_provs.append(tuple(rank_provs))
    return Program(tuple(all_reqs), tuple(all_provs), num_stages, per_kind, stride)


def run_program(schedule, program: Program, durations, comm) -> tuple[list[list[float]], list[list[float]]]:
    """Run every rank's ops in order, each as early as its rank and inputs allow.

    ``durations[r][i]`` is the time of op ``i`` on rank ``r``; ``comm[stage]`` is the
    latency added when the producer ``stage`` is on another rank. Returns per-rank
    ``(starts, ends)``. Raises :class:`DeadlockError` naming a stuck rank, its op and
    the missing input when no rank can progress. Linear in the number of ops.
    """
    num_ranks = len(program.reqs)
    done: dict[int, float] = {}
    waiters: dict[int, list[int]] = {}
    ptr = [0] * num_ranks
    free_at = [0.0] * num_ranks
    starts = [[0.0] * len(r) for r in program.reqs]
    ends = [[0.0] * len(r) for r in program.reqs]
    stack = list(range(num_ranks - 1, -1, -1))
    while stack:
        r = stack.pop()
        reqs_r, provs_r, dur_r = program.reqs[r], program.provs[r], durations[r]
        i, n = ptr[r], len(reqs_r)
        t_free = free_at[r]
        while i < n:
            t = t_free
            blocked = False
            for key, cross, src in reqs_r[i]:
                d = done.get(key)
                if d is None:
                    waiters.setdefault(key, []).append(r)
                    blocked = True
                    break
                if cross:
                    d += comm[src]
                if d > t:
                    t = d
            if blocked:
                break
            end = t + dur_r[i]
            starts[r][i] = t
            ends[r][i] = end
            for key in provs_r[i]:
                done[key] = end
                woken = waiters.pop(key, None)
                if woken:
                    stack.extend(woken)
            t_free = end
            i += 1
        ptr[r] = i
        free_at[r] = t_free
    stuck = [r for r in range(num_ranks) if ptr[r] < len(program.reqs[r])]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, program, stuck, ptr, done))
    return starts, ends


def _deadlock_message(schedule, program: Program, stuck, ptr, done) -> str:
    lines = []
    for r in stuck[:4]:
        i = ptr[r]
        op = schedule.ops[r][i]
        missing = next(k for k, _, _ in program.reqs[r][i] if k not in done)
        kind, stage, mb = program.decode(missing)
        producer = schedule.layout.stage_rank[stage]
        lines.append(
            f"rank {r} is stuck at op #{i} {op} waiting for the {_KEY_NAMES[kind]} of stage "
            f"{stage} micro-batch {mb} (on rank {producer}), which never runs before it"
        )
    more = f" (and {len(stuck) - 4} more ranks)" if len(stuck) > 4 else ""
    return "deadlock: the derived sends/receives cannot make progress: " + "; ".join(lines) + more
