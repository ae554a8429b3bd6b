"""Scheduling policies: DeepSeek's four-level prefill balancing, time-budget chunking and
the two-axis decode balancer. Pure functions over plain numbers, so they are easy to test
on their own and to reuse outside the simulator.

Prefill (four levels):
  1. :func:`length_bucket`: <16K, 16-64K, 64-256K, >=256K tokens (default edges), each
     bucket served by its own set of instances so long prompts do not block short ones;
  2. :func:`pick_by_quota`: among the bucket's instances, the one with the least pending
     predicted work per unit of compute quota (no prefix affinity: the KV store is global);
  3. :func:`pick_by_quota` again over the instance's DP ranks (equal quota): the rank with
     the least predicted cost, so synchronised ranks finish together;
  4. :func:`chunk_for_budget`: each step's chunk is the largest q whose cost fits the time
     budget given the cached prefix c.
Decode: :func:`pick_decode` sends short requests where the running count is low and long
requests where the total KV length is low.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Optional, Sequence

#: Prefill length-bucket edges in tokens: <16K, 16-64K, 64-256K, >=256K.
DEFAULT_BUCKET_EDGES = (16 * 1024, 64 * 1024, 256 * 1024)


def length_bucket(num_tokens: int, edges: Sequence[int] = DEFAULT_BUCKET_EDGES) -> int:
    """Bucket index of a prompt of ``num_tokens`` tokens: 0 for < edges[0], ...,
    len(edges) for >= edges[-1]."""
    return bisect.bisect_right(edges, num_tokens)


def check_edges(edges: Sequence[int]) -> tuple:
    edges = tuple(int(e) for e in edges)
    if any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise ValueError(f"bucket edges must be strictly increasing positive token counts, got {edges}")
    return edges


def pick_by_quota(pending: Sequence[float], quota: Optional[Sequence[float]] = None,
                  allowed: Optional[Sequence[int]] = None) -> int:
    """Index minimising pending work / quota among ``allowed`` (all by default); ties go
    to the lowest index. ``pending``: predicted seconds of queued work."""
    idx = range(len(pending)) if allowed is None else allowed
    best, best_v = -1, math.inf
    for i in idx:
        q = 1.0 if quota is None else quota[i]
        if q <= 0:
            continue
        v = pending[i] / q
        if v < best_v:
            best, best_v = i, v
    if best < 0:
        raise ValueError("no instance with a positive compute quota to choose from")
    return best


def chunk_for_budget(cost: Callable[[Sequence[tuple[int, int]]], float],
                     base: Sequence[tuple[int, int]], cached: int, max_q: int,
                     budget: float) -> int:
    """Largest q in [0, max_q] with ``cost(base + [(q, cached)]) <= budget``.

    ``cost`` must be non-decreasing in q (a prefill step-time function). When ``base`` is
    empty the step must make progress, so at least 1 is returned even if one token
    exceeds the budget. Binary search: O(log max_q) cost calls."""
    if max_q <= 0:
        return 0
    base = list(base)
    floor = 0 if base else 1
    if cost(base + [(max_q, cached)]) <= budget:
        return max_q
    lo, hi = 0, max_q          # cost(lo) fits (or lo = 0), cost(hi) does not
    if cost(base + [(1, cached)]) > budget:
        return floor
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(base + [(mid, cached)]) <= budget:
            lo = mid
        else:
            hi = mid
    return max(lo, floor)


def pick_decode(counts: Sequence[int], kv_totals: Sequence[float], context_len: int,
                long_threshold: int, fits: Optional[Sequence[bool]] = None) -> int:
    """Decode instance (or rank) for a request of ``context_len`` tokens.

    Short requests (< ``long_threshold``) go to the lowest running ``counts`` (ties: lower
    KV total, then index), long ones to the lowest ``kv_totals`` (ties: lower count, then
    index). Only indices with ``fits[i]`` true are candidates; -1 if there is none."""
    best, best_key = -1, None
    long_req = context_len >= long_threshold
    for i in range(len(counts)):
        if fits is not None and not fits[i]:
            continue
        key = (kv_totals[i], counts[i], i) if long_req else (counts[i], kv_totals[i], i)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best
