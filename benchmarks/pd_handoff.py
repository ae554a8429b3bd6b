"""PD disaggregation on 8 simulated CPU devices: KV handoff throughput, the share of the
transfer hidden under prefill compute, and decode steps per second at 1, 8 and 32 running
requests (paged cache, DP2 x EP2 decode mesh).

Hidden share: the prefill pushes every layer's latent rows to the decode rank as the layer
finishes; a watcher thread records when each copy has landed. A layer whose copy landed
before the prefill finished was hidden under the compute of the later layers. The link
throughput is the copy of all layers' rows timed alone. Simulated CPU devices share the
host's cores and memory, so the "link" is a memcpy: the numbers show the mechanism, not a
network.

Run: .venv/bin/python benchmarks/pd_handoff.py [--preset small]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402
from pdjax.disagg.decode import DecodePool  # noqa: E402
from pdjax.disagg.prefill import PrefillPool  # noqa: E402
from pdjax.disagg.request import Request  # noqa: E402


def median_time(fn, repeats=5):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt", type=int, default=1024)
    args = ap.parse_args()
    cfg = pdjax.configs.preset(args.preset)
    params = pdjax.init_params(cfg, jax.random.key(0))
    devs = jax.devices()
    prefill = PrefillPool(params, cfg, devs[:4], {"expert": 4})
    decode = DecodePool(params, cfg, devs[4:], {"data": 2, "expert": 2}, slots=32, block_size=16,
                        max_context=max(args.prompt, 64) + 64)
    rng = np.random.RandomState(0)
    req = Request(0, rng.randint(0, cfg.vocab_size, args.prompt).tolist(), 8)
    res = decode.reserve(req)
    target = decode.target_device(res)

    def with_handoff():
        """Prefill pushing each layer as it finishes; a watcher thread records when each
        layer's copy has landed. Returns (t_prefill_done, [t_landed per layer]) from start."""
        landed = [None] * cfg.num_hidden_layers
        watchers = []
        t0 = time.perf_counter()

        def push(l, rows, start):
            moved = jax.device_put(rows, target)

            def watch():
                moved.block_until_ready()
                landed[l] = time.perf_counter() - t0
            th = threading.Thread(target=watch)
            th.start()
            watchers.append(th)
        prefill.run(req, push)
        t_done = time.perf_counter() - t0
        for th in watchers:
            th.join()
        return t_done, landed

    _, rows = prefill.run(req, lambda l, r, s: None)          # compile; keep the rows
    jax.block_until_ready(rows)
    with_handoff()

    def transfer_alone():
        jax.block_until_ready([jax.device_put(r, target) for r in rows])

    transfer_alone()
    t_xfer = median_time(transfer_alone)
    runs = [with_handoff() for _ in range(3)]
    nbytes = sum(r.size * r.dtype.itemsize for r in rows)
    hidden = [sum(t <= t_done for t in landed) / len(landed) for t_done, landed in runs]
    t_done, landed = runs[-1]
    print(f"## KV handoff: {args.preset} ({cfg.num_hidden_layers} layers), prompt {args.prompt} tokens, "
          f"prefill EP4 on devices 0-3 -> decode rank {res.rank} (device {target.id})")
    print(f"bytes handed off        {nbytes:,} B = {args.prompt} x {cfg.kv_latent_dim} x {cfg.num_hidden_layers} "
          f"x {rows[0].dtype.itemsize} B")
    print(f"transfer alone          {1e3 * t_xfer:9.2f} ms  -> link throughput {nbytes / t_xfer / 1e9:.2f} GB/s")
    print(f"prefill (with handoff)  {1e3 * t_done:9.2f} ms; layer copies landed at (ms): "
          + ", ".join(f"{1e3 * t:.0f}" for t in landed))
    print("hidden share (layers whose copy landed before the prefill finished): "
          + ", ".join(f"{100 * h:.0f} %" for h in hidden) + " over 3 runs")
    print("(the last layer's copy can only start when the prefill's last layer is done)\n")
    decode.cancel(res)

    # decode steps per second at n running requests
    print("## decode steps/s (paged cache, 32 slots over DP2 x EP2)")
    print(f"{'running':>8}{'ms/step':>10}{'steps/s':>10}{'tokens/s':>10}")
    short = [Request(i + 1, rng.randint(0, cfg.vocab_size, 32).tolist(), 64) for i in range(32)]
    admitted = 0
    for n in (1, 8, 32):
        while admitted < n:
            r = short[admitted]
            rv = decode.reserve(r)
            tok, layer_rows = prefill.run(r, lambda l, x, s: None)
            for l, x in enumerate(layer_rows):
                decode.receive_layer(rv, l, jax.device_put(x, decode.target_device(rv)))
            decode.admit(rv, tok)
            admitted += 1
        decode.step()                                           # warm
        t = median_time(decode.step, repeats=7)
        print(f"{n:>8}{1e3 * t:>10.2f}{1 / t:>10.1f}{n / t:>10.1f}")


if __name__ == "__main__":
    main()
