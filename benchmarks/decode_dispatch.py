"""How far a Python loop of ``pdjax.decode_step`` runs ahead of the device.

The loop feeds each step's argmax back as the next tokens, all on the device. Nothing in
``decode_step`` reads a device value (module docstring of pdjax/model/transformer.py), so
the calls return before their steps run: the host issues step i+1, i+2, ... while step 1
still computes, and the device never waits for Python. Measured per trial (a fresh prefill,
then ``--steps`` steps):

* issued before step 1 was done: how many steps the loop had issued when the first step's
  logits became ready (polled with ``is_ready()`` after each call; "all" when the loop
  issued every step first);
* issue ms: wall time of the loop itself, the host's share of the work;
* wall ms: until the last step's tokens are ready;
* the same loop with a host round trip per step (``np.asarray`` of the tokens, as a
  loop that checks or prints them does): each step waits for the previous one.

Medians of ``--repeats`` trials, the two loops interleaved. The ratio of the two walls
is what dispatching ahead saves; on a 2-core CPU the host and the device share the cores,
so it is small there (the saving is the per-step Python and dispatch time; on a GPU that
time overlaps the device's work entirely).

Run: .venv/bin/python benchmarks/decode_dispatch.py [--steps 100] [--batch 8] [--config small]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pdjax


def trial(params, cfg, prompt, steps: int, host_sync: bool) -> dict:
    """One prefill, then ``steps`` decode steps fed their own argmax; times in seconds."""
    logits, cache = pdjax.prefill(params, cfg, prompt, max_len=prompt.shape[1] + steps + 1)
    tok = jax.block_until_ready(jnp.argmax(logits[:, -1], -1))
    first, before_first = None, None
    t0 = time.perf_counter()
    for i in range(steps):
        step, cache = pdjax.decode_step(params, cfg, tok, cache)
        tok = jnp.argmax(step, -1)
        if host_sync:
            tok = jnp.asarray(np.asarray(tok))          # a host round trip per step
        if first is None:
            first = step
        elif before_first is None and first.is_ready():
            before_first = i                            # steps 1..i were issued when step 1 was seen done
    issue = time.perf_counter() - t0
    tok.block_until_ready()
    return {"issue": issue, "wall": time.perf_counter() - t0,
            "before_first": steps if before_first is None else before_first}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small", help="a pdjax.configs preset (default small)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if min(args.batch, args.prompt, args.steps, args.repeats) < 1:
        raise SystemExit("--batch, --prompt, --steps and --repeats must be positive")
    cfg = pdjax.configs.preset(args.config)
    params = pdjax.init_params(cfg, jax.random.key(0))
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    trial(params, cfg, prompt, 2, False)                # compile prefill and decode_step
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for host_sync in (False, True):
            runs[host_sync].append(trial(params, cfg, prompt, args.steps, host_sync))

    def med(host_sync, key):
        return statistics.median(r[key] for r in runs[host_sync])

    print(f"## decode_step loop, argmax fed back: {args.config}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.steps} steps, {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
          f"median of {args.repeats}")
    print(f"{'loop':<34}{'issued before step 1 done':>27}{'issue ms':>10}{'wall ms':>9}{'ms/step':>9}")
    for host_sync, name in ((False, "tokens stay on the device"), (True, "host round trip per step")):
        before = med(host_sync, "before_first")
        shown = "all" if before >= args.steps else f"{before:g}"
        print(f"{name:<34}{shown:>27}{1e3 * med(host_sync, 'issue'):>10.1f}{1e3 * med(host_sync, 'wall'):>9.1f}"
              f"{1e3 * med(host_sync, 'wall') / args.steps:>9.2f}")
    print(f"wall, on device / round trip: {med(False, 'wall') / med(True, 'wall'):.2f}")


if __name__ == "__main__":
    main()
