"""Scheduling pieces of the PD engines: the FIFO pool lock of a colocated engine, the
largest chunk within a time budget under a prefill cost model, the device-to-device link
bandwidth probe, and the sampler of the three DOPD signals."""

from __future__ import annotations

import collections
import threading
import time

import jax
import numpy as np

from pdjax.disagg.prefill import bucket


class FifoLock:
    """A lock granted in request order: a prefill that releases it between chunks lets a
    decode step that is already waiting run before its next chunk."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: collections.deque = collections.deque()
        self._held = False

    def __enter__(self):
        me = object()
        with self._cond:
            self._waiting.append(me)
            while self._held or self._waiting[0] is not me:
                self._cond.wait()
            self._waiting.popleft()
            self._held = True

    def __exit__(self, *exc):
        with self._cond:
            self._held = False
            self._cond.notify_all()


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


def measure_link_bandwidth(src, dst, nbytes: int = 8 << 20, repeats: int = 3) -> float:
    """Bytes per second of a device_put from device ``src`` to device ``dst`` (best of
    ``repeats``, after a warm-up copy)."""
    x = jax.device_put(np.zeros(nbytes // 4, np.float32), src)
    jax.device_put(x, dst).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.device_put(x, dst).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


class Signals:
    """The three DOPD signals, sampled every ``interval`` seconds of the decode loop:
    prefill queue depth (``depth()``: arrived requests waiting for decode room or for a
    prefill worker), P95 decode KV-wait of the requests admitted in the interval, and KV link
    utilisation (bytes that arrived in the interval over interval x the link bandwidth)."""

    interval = 0.1

    def __init__(self, link_bandwidth_Bps, depth, clock):
        self.link_bandwidth_Bps, self.depth, self.clock = link_bandwidth_Bps, depth, clock
        self.rows: list[dict] = []
        self.bytes = 0
        self.kv_waits: list[float] = []
        self.t_last = 0.0

    def sample(self) -> None:
        t = self.clock.now()
        if t - self.t_last < self.interval:
            return
        bw = self.link_bandwidth_Bps
        self.rows.append({"t": t, "prefill_queue_depth": self.depth(),
                          "decode_kv_wait_p95_s": float(np.percentile(self.kv_waits, 95)) if self.kv_waits else 0.0,
                          "link_utilisation": self.bytes / ((t - self.t_last) * bw) if bw else 0.0})
        self.bytes, self.kv_waits, self.t_last = 0, [], t
