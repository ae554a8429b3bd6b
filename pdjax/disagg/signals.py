"""What a PD engine measures while it serves: the device-to-device link bandwidth probe and
the sampler of the three DOPD signals (prefill queue depth, decode KV wait, link use)."""

from __future__ import annotations

import time

import jax
import numpy as np


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
