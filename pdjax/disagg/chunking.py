"""Chunked prefill under a time budget: the largest chunk a prefill cost model fits in a
budget, rounded down to whole padding buckets of a prefill pool."""

from __future__ import annotations

from pdjax.disagg.prefill import bucket


def largest_chunk(cost, c: int, budget_s: float, q_max: int) -> int:
    """The largest q <= q_max with cost(q, c) <= budget_s, at least 1 (a chunk must make
    progress). Uses ``cost.max_chunk`` when the model has it, else bisection (cost is
    non-decreasing in q)."""
    if hasattr(cost, "max_chunk"):
        return max(1, cost.max_chunk(c, budget_s, q_max=q_max))
    return max(1, _last_true(lambda q: cost(q, c) <= budget_s, 0, q_max))


def whole_buckets(q: int, size: int) -> int:
    """The largest chunk v <= max(q, smallest bucket) whose padded size bucket(v, size) fits in
    it: a prefill pool runs bucket(v) rows, so a chunk chosen for a time budget must not be
    padded past it (and a chunk smaller than the smallest bucket costs a whole bucket anyway)."""
    room = max(q, bucket(1, size))
    v = _last_true(lambda v: bucket(v, size) <= room, 1, room)
    return v if bucket(v, size) <= room else q


def _last_true(ok, lo: int, hi: int) -> int:
    """The largest v in [lo, hi] with ok(v), for ok true up to some point and false after
    (lo when none is: the caller checks)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
