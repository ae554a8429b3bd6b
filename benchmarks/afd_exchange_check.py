"""What the AF exchange's integrity check costs: the decode step of an AFDEngine with the
exchange sealed (pdjax.disagg.afd_ffn.seal/unseal: checksums computed by the sending
program, moved with each piece, recomputed and compared by the receiving one, the verdict
read with the tokens) against the same engine with pass-through seals (nothing computed or
moved: the exchange as it was before the check).

Both variants are compiled once (the unchecked one as copies of the two programs that seal
and unseal, traced with pass-through seals) and then alternate, one ``generate`` each, for
``--rounds`` rounds on one engine, so a shared machine's drifting load falls on both alike.
Per variant: the wall time of every decode step (``pool.step``, which ends with the step's
one host read, so its wall time is the step's): median and 10th percentile, and the ratio
checked / unchecked of each.

Run: PYTHONPATH=. .venv/bin/python benchmarks/afd_exchange_check.py [--preset tiny]
     [--ratio 4:4] [--microbatches 2] [--slots 8] [--new-tokens 24] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402
from pdjax.disagg import AFDEngine, afd_attention, afd_ffn  # noqa: E402

CHECKED = {"seal": afd_ffn.seal, "unseal": afd_ffn.unseal, "_segment": afd_attention._segment, "_routed": afd_ffn._routed}


def _pass_seal(pieces, mesh, poison=None):
    return tuple((p, ()) for p in pieces)          # an empty seal: no leaf, nothing moves


def _pass_unseal(sealed, mesh):
    return tuple(p for p, _ in sealed), (0,) * len(sealed)


UNCHECKED = {"seal": _pass_seal, "unseal": _pass_unseal,      # copies of the programs: their own caches
             "_segment": jax.jit(afd_attention._segment.__wrapped__, static_argnames=("cfg", "paging", "parts"),
                                 donate_argnames=("pools",)),
             "_routed": jax.jit(afd_ffn._routed.__wrapped__, static_argnames=("cfg", "ep"))}


def use(checked: bool) -> None:
    """Install the sealed (or the pass-through) exchange and its compiled programs."""
    for name, fn in (CHECKED if checked else UNCHECKED).items():
        for mod in (afd_ffn, afd_attention):
            if hasattr(mod, name):
                setattr(mod, name, fn)


def step_times(params, cfg, M, N, m, slots, prompts, new_tokens, rounds) -> dict:
    eng = AFDEngine(params, cfg, attention_devices=jax.devices()[:M], ffn_devices=jax.devices()[M:M + N],
                    num_microbatches=m, max_decode_slots=slots, block_size=32, max_context=128)
    times: dict = {True: [], False: []}
    step, variant = eng.decode.step, [True]

    def timed():
        t0 = time.perf_counter()
        out = step()
        times[variant[0]].append(time.perf_counter() - t0)
        return out
    eng.decode.step = timed
    ref = None
    for r in range(1 + rounds):
        for checked in (True, False):
            use(checked)
            variant[0] = checked
            out = eng.generate(prompts, max_new_tokens=new_tokens)
            ref = ref or out
            assert out == ref and eng.stats["afd"]["exchange_corrupt"] == 0
            if r == 0:                                                # warm-up: compiles
                times[checked].clear()
    use(True)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ratio", default="4:4", help="M:N attention:FFN devices")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    M, N = (int(x) for x in args.ratio.split(":"))
    cfg = pdjax.configs.preset(args.preset)
    params = pdjax.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(0, cfg.vocab_size, n)) for n in rng.randint(1, 60, args.slots)]
    times = step_times(params, cfg, M, N, args.microbatches, args.slots, prompts, args.new_tokens, args.rounds)
    stat = {}
    for checked, label in ((True, "checked"), (False, "unchecked")):
        t = times[checked]
        stat[checked] = (statistics.median(t), float(np.percentile(t, 10)))
        print(f"{label:>10}: step median {1e3 * stat[checked][0]:.2f} ms, p10 {1e3 * stat[checked][1]:.2f} ms, "
              f"p90 {1e3 * np.percentile(t, 90):.2f} ms over {len(t)} steps")
    print(f"\n{args.preset} {M}:{N}, m={args.microbatches}, {args.slots} slots on {jax.device_count()} CPU devices: "
          f"checked / unchecked step: median {stat[True][0] / stat[False][0]:.3f}, "
          f"p10 {stat[True][1] / stat[False][1]:.3f}")


if __name__ == "__main__":
    main()
