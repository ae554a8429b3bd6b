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

from .ops import BACKWARD_WEIGHT, FORWARD, Op

ACT, GRAD = 0, 1  # key kinds: forward activation ready, input gradient ready
_KEY_NAMES = {ACT: "forward", GRAD: "input-grad backward"}


@dataclass(frozen=True)
class Program:
    """Per rank: ops compiled to flat integer arrays (no per-op objects).

    Op ``i`` of rank ``r`` requires the keys ``req_key[r][req_at[r][i]:req_at[r][i+1]]``;
    ``req_src[r][j]`` is the producer stage of requirement ``j`` when it lives on another
    rank (a send/recv that pays ``comm``), else ``-1``. The op provides the keys
    ``prov_key[r][prov_at[r][i]:prov_at[r][i+1]]``. Keys encode ``(kind, stage,
    microbatch)`` in ``[0, num_keys)`` (see :meth:`decode`); when that key space is much
    larger than the schedule (micro-batch ids far above the layout's, e.g. an unchecked
    CSV), the keys used are renumbered ``0..`` and ``original_keys`` maps them back.
    """

    req_at: tuple[list[int], ...]
    req_key: tuple[list[int], ...]
    req_src: tuple[list[int], ...]
    prov_at: tuple[list[int], ...]
    prov_key: tuple[list[int], ...]
    num_stages: int
    num_keys_per_kind: int
    key_stride: int
    original_keys: tuple[int, ...] | None = None

    @property
    def num_ranks(self) -> int:
        return len(self.req_at)

    @property
    def num_keys(self) -> int:
        if self.original_keys is not None:
            return len(self.original_keys)
        return 2 * self.num_keys_per_kind

    def requirements(self, rank: int, index: int) -> list[int]:
        """Keys op ``index`` of ``rank`` waits for."""
        at = self.req_at[rank]
        return self.req_key[rank][at[index]:at[index + 1]]

    def decode(self, key: int) -> tuple[int, int, int]:
        """``key -> (kind, stage, microbatch)``."""
        if self.original_keys is not None:
            key = self.original_keys[key]
        kind, rest = divmod(key, self.num_keys_per_kind)
        stage, mb = divmod(rest, self.key_stride)
        return kind, stage, mb


class DeadlockError(ValueError):
    """No rank can make progress: a cycle through the derived sends/receives."""


def compile_program(schedule) -> Program:
    """Compile a schedule's ops to integer dependency keys (see module docstring).

    Appends plain ints to a few flat lists per rank: no per-op tuples or lists, so the
    cost per op does not depend on the schedule's size (no garbage-collector work grows
    with it, and the arrays stay compact).
    """
    layout = schedule.layout
    stride = max(schedule.max_microbatch + 1, layout.num_microbatches, 1)
    per_kind = layout.num_stages * stride
    stage_rank, prev_stage, next_stage = layout.stage_rank, layout.prev_stage, layout.next_stage
    # per stage: the producer stage of its forward / backward input when that producer is
    # on another rank (the dependency pays comm[producer]), else -1
    fwd_src = [p if p >= 0 and stage_rank[p] != stage_rank[s] else -1 for s, p in enumerate(prev_stage)]
    bwd_src = [n if n >= 0 and stage_rank[n] != stage_rank[s] else -1 for s, n in enumerate(next_stage)]
    all_req_at, all_req_key, all_req_src, all_prov_at, all_prov_key = [], [], [], [], []
    for ops in schedule.ops:
        req_at, req_key, req_src, prov_at, prov_key = [0], [], [], [0], []
        add_req_key, add_req_src, add_prov_key = req_key.append, req_src.append, prov_key.append
        for op in ops:
            for part in ((op,) if type(op) is Op else op.parts):
                s = part.stage
                base = s * stride + part.microbatch
                kind = part.kind
                if kind == FORWARD:
                    p = prev_stage[s]
                    if p >= 0:
                        add_req_key(base + (p - s) * stride)
                        add_req_src(fwd_src[s])
                    add_prov_key(base)
                elif kind == BACKWARD_WEIGHT:
                    add_req_key(per_kind + base)
                    add_req_src(-1)
                else:  # B or I
                    add_req_key(base)
                    add_req_src(-1)
                    n = next_stage[s]
                    if n >= 0:
                        add_req_key(per_kind + base + (n - s) * stride)
                        add_req_src(bwd_src[s])
                    add_prov_key(per_kind + base)
            req_at.append(len(req_key))
            prov_at.append(len(prov_key))
        all_req_at.append(req_at)
        all_req_key.append(req_key)
        all_req_src.append(req_src)
        all_prov_at.append(prov_at)
        all_prov_key.append(prov_key)
    original_keys = None
    num_refs = sum(map(len, all_req_key)) + sum(map(len, all_prov_key))
    if 2 * per_kind > 8 * num_refs + 4096:  # sparse: renumber the keys in use
        ids: dict[int, int] = {}
        for keys in all_req_key + all_prov_key:
            keys[:] = [ids.setdefault(k, len(ids)) for k in keys]
        original_keys = tuple(ids)
    return Program(tuple(all_req_at), tuple(all_req_key), tuple(all_req_src), tuple(all_prov_at),
                   tuple(all_prov_key), layout.num_stages, per_kind, stride, original_keys)


def run_program(schedule, program: Program, durations, comm) -> tuple[list[list[float]], list[list[float]]]:
    """Run every rank's ops in order, each as early as its rank and inputs allow.

    ``durations[r][i]`` is the time of op ``i`` on rank ``r``; ``comm[stage]`` is the
    latency added when the producer ``stage`` is on another rank. Returns per-rank
    ``(starts, ends)``. Raises :class:`DeadlockError` naming a stuck rank, its op and
    the missing input when no rank can progress. Linear in the number of ops: each op
    runs once, each block registers one waiter, and the end time of every key lives in
    one preallocated list indexed by key (``None``: not produced yet).
    """
    num_ranks = program.num_ranks
    done: list = [None] * program.num_keys
    waiters: dict[int, list[int]] = {}
    ptr = [0] * num_ranks
    free_at = [0.0] * num_ranks
    starts = [[0.0] * (len(at) - 1) for at in program.req_at]
    ends = [[0.0] * (len(at) - 1) for at in program.req_at]
    stack = list(range(num_ranks - 1, -1, -1))
    while stack:
        r = stack.pop()
        req_at, req_key, req_src = program.req_at[r], program.req_key[r], program.req_src[r]
        prov_at, prov_key = program.prov_at[r], program.prov_key[r]
        dur_r, starts_r, ends_r = durations[r], starts[r], ends[r]
        i, n = ptr[r], len(req_at) - 1
        t_free = free_at[r]
        j = req_at[i]
        while i < n:
            t = t_free
            j_end = req_at[i + 1]
            while j < j_end:
                d = done[req_key[j]]
                if d is None:
                    break
                src = req_src[j]
                if src >= 0:
                    d += comm[src]
                if d > t:
                    t = d
                j += 1
            if j < j_end:  # blocked on req_key[j]
                waiters.setdefault(req_key[j], []).append(r)
                break
            end = t + dur_r[i]
            starts_r[i] = t
            ends_r[i] = end
            for k in range(prov_at[i], prov_at[i + 1]):
                key = prov_key[k]
                done[key] = end
                if key in waiters:
                    stack.extend(waiters.pop(key))
            t_free = end
            i += 1
        ptr[r] = i
        free_at[r] = t_free
    stuck = [r for r in range(num_ranks) if ptr[r] < len(program.req_at[r]) - 1]
    if stuck:
        raise DeadlockError(_deadlock_message(schedule, program, stuck, ptr, done))
    return starts, ends


def _deadlock_message(schedule, program: Program, stuck, ptr, done) -> str:
    lines = []
    for r in stuck[:4]:
        i = ptr[r]
        op = schedule.ops[r][i]
        missing = next(k for k in program.requirements(r, i) if done[k] is None)
        kind, stage, mb = program.decode(missing)
        producer = schedule.layout.stage_rank[stage]
        lines.append(
            f"rank {r} is stuck at op #{i} {op} waiting for the {_KEY_NAMES[kind]} of stage "
            f"{stage} micro-batch {mb} (on rank {producer}), which never runs before it"
        )
    more = f" (and {len(stuck) - 4} more ranks)" if len(stuck) > 4 else ""
    return "deadlock: the derived sends/receives cannot make progress: " + "; ".join(lines) + more
