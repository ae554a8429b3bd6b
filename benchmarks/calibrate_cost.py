"""Calibrate the cost models against the real JAX model, configs.small(), on the current
backend, and report the error on held-out shapes (target: median <= 10 %):

* prefill cost(q, c) = a q^2 + b q c + g q (+ d) of one chunked-prefill call;
* decode t(B, K) = d0 + d1 B + d2 K of one decode step (B requests, K = B L cached tokens).

Prefill protocol (pdjax.timing.calibrate): a cache of c + q positions is filled with a
real prefix of c tokens by chunked prefill, then a chunk of q tokens continuing from it is
timed (block_until_ready), compilation and warm-up excluded, repeats interleaved over the
shapes in shuffled rounds. The same measurements are fitted four ways: the source
articles' three-term form and with a constant d, each on the median and on the min of the
repeats.
Column "MoE C": base rows per expert of the bucketed MoE (the CPU default), ceil(1.125 * 2q / 16)
(:func:`pdjax.model.moe.bucket_layout`; chunks of <= 16 tokens run through every expert).

Decode protocol (pdjax.timing.calibrate_decode): B requests of L cached tokens each in a
cache of exactly L + 1 positions (filled by a real prefill of L_max tokens, first L kept;
8 distinct prompts, repeated for B > 8), one decode step timed per call, same interleaving;
fitted on the median and on the min of the repeats.

Run: .venv/bin/python benchmarks/calibrate_cost.py [--repeats 5] [--skip-prefill]
(~3 min on 2 shared cores)
"""

from __future__ import annotations

import argparse
import os
import time

import jax

import pdjax
from pdjax import analysis as A
from pdjax import timing
from pdjax.model import moe as moe_lib

jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               ".jax_cache"))

FIT = [(64, 0), (128, 0), (256, 0), (512, 0), (64, 128), (128, 256), (256, 512), (512, 1024)]
HELD_OUT = [(64, 64), (128, 128), (256, 256), (512, 512)]

# decode: (B requests, L cached tokens each); B in 1..32, L in 64..1024
DECODE_FIT = [(1, 64), (8, 64), (32, 64), (1, 256), (32, 256), (16, 512), (1, 1024), (8, 1024),
              (32, 1024)]
DECODE_HELD_OUT = [(4, 128), (16, 128), (8, 256), (4, 512), (16, 1024)]
DECODE_DISTINCT_ROWS = 8


def moe_rows(cfg, q: int) -> int:
    """Base rows per expert C of the bucketed MoE for a chunk of q tokens (batch 1)."""
    return moe_lib.bucket_layout(q * cfg.num_experts_per_tok, cfg.n_routed_experts)[0]


def prefill_report(params, cfg, repeats: int, seed: int) -> None:
    t0 = time.perf_counter()
    result = timing.calibrate(params, cfg, FIT, repeats=repeats, holdout=HELD_OUT, seed=seed)
    elapsed = time.perf_counter() - t0

    print(f"== prefill: configs.small() ({cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), "
          f"batch 1, backend {jax.default_backend()}, {repeats} interleaved repeats\n")
    variants = {(stat, icpt): result.refit(intercept=icpt, statistic=stat)
                for stat in ("median", "min") for icpt in (False, True)}
    best = variants[("median", True)]
    print("measured (median of repeats) vs predicted by the three-term fit and by the fit "
          "with a constant d")
    print(f"{'q':>5} {'c':>5} {'split':>9} {'MoE C':>6} {'measured ms':>12} "
          f"{'3-term ms':>10} {'err':>6} {'+d ms':>9} {'err':>6} {'max/min':>8}")
    for r3, rd in zip(result.rows(), best.rows()):
        print(f"{r3['q']:>5} {r3['c']:>5} {r3['split']:>9} {moe_rows(cfg, r3['q']):>6} "
              f"{r3['measured_s'] * 1e3:>12.1f} {r3['predicted_s'] * 1e3:>10.1f} "
              f"{r3['rel_error'] * 100:>5.1f}% {rd['predicted_s'] * 1e3:>9.1f} "
              f"{rd['rel_error'] * 100:>5.1f}% {r3['spread']:>8.2f}")

    print("\nfits (held-out relative error on the shapes marked held-out)")
    print(f"{'statistic':>9} {'form':>8} {'a s/tok^2':>10} {'b s/tok^2':>10} {'g s/tok':>10} "
          f"{'d s':>8} {'R^2':>7} {'median err':>10} {'max err':>8}")
    for (stat, icpt), res in variants.items():
        f = res.fit
        print(f"{stat:>9} {'+d' if icpt else '3-term':>8} {f.a:>10.3g} {f.b:>10.3g} "
              f"{f.g:>10.3g} {f.d:>8.3g} {f.r2:>7.4f} {res.median_error * 100:>9.1f}% "
              f"{res.max_error * 100:>7.1f}%")
    budget = 1.5 * best.fit(256, 512)
    print(f"\nchunk policy with the median +d fit: budget {budget * 1e3:.0f} ms -> "
          + ", ".join(f"c={c}: q={best.fit.max_chunk(c, budget, align=64)}"
                      for c in (0, 512, 1024)) + " (align 64)")
    print(f"prefill calibration runtime {elapsed:.0f} s\n")


def decode_report(params, cfg, repeats: int, seed: int) -> None:
    t0 = time.perf_counter()
    result = timing.calibrate_decode(params, cfg, DECODE_FIT, repeats=repeats,
                                holdout=DECODE_HELD_OUT, seed=seed,
                                distinct_rows=DECODE_DISTINCT_ROWS)
    elapsed = time.perf_counter() - t0
    print(f"== decode: configs.small(), one decode_step of B requests with L cached tokens each "
          f"(K = B L), backend {jax.default_backend()}, {repeats} interleaved repeats, "
          f"{DECODE_DISTINCT_ROWS} distinct prompts\n")
    by_min = result.refit(statistic="min")
    print(f"{'B':>4} {'L':>5} {'K':>6} {'split':>9} {'measured ms':>12} {'pred ms':>8} "
          f"{'err':>6} {'min ms':>7} {'pred ms':>8} {'err':>6} {'max/min':>8}")
    for rm, rn in zip(result.rows(), by_min.rows()):
        print(f"{rm['B']:>4} {rm['L']:>5} {rm['K']:>6} {rm['split']:>9} "
              f"{rm['measured_s'] * 1e3:>12.2f} {rm['predicted_s'] * 1e3:>8.2f} "
              f"{rm['rel_error'] * 100:>5.1f}% {rn['measured_s'] * 1e3:>7.2f} "
              f"{rn['predicted_s'] * 1e3:>8.2f} {rn['rel_error'] * 100:>5.1f}% "
              f"{rm['spread']:>8.2f}")
    print("\nfits (held-out relative error on the shapes marked held-out)")
    print(f"{'statistic':>9} {'d0 s':>9} {'d1 s/req':>9} {'d2 s/tok':>9} {'R^2':>7} "
          f"{'median err':>10} {'max err':>8}")
    for res in (result, by_min):
        f = res.fit
        print(f"{res.statistic:>9} {f.d0:>9.3g} {f.d1:>9.3g} {f.d2:>9.3g} {f.r2:>7.4f} "
              f"{res.median_error * 100:>9.1f}% {res.max_error * 100:>7.1f}%")
    print(f"decode calibration runtime {elapsed:.0f} s\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()

    t0 = time.perf_counter()
    cfg = pdjax.configs.small()
    params = pdjax.init_params(cfg, jax.random.key(0))
    if not args.skip_prefill:
        prefill_report(params, cfg, args.repeats, args.seed)
    if not args.skip_decode:
        decode_report(params, cfg, args.repeats, args.seed)
    print(f"total runtime {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
