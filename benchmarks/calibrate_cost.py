"""Calibrate the prefill cost model cost(q, c) = a q^2 + b q c + g q against the real JAX
chunked prefill of configs.small() on the current backend, and report the error on
held-out shapes (target: median <= 10 %).

Protocol (pdjax.analysis.calibrate): a cache of c + q positions is filled with a real
prefix of c tokens by chunked prefill, then a chunk of q tokens continuing from it is
timed (block_until_ready), compilation and warm-up excluded, repeats interleaved over the
shapes in shuffled rounds. The same measurements are fitted four ways: the brief's
three-term form and with a constant d, each on the median and on the min of the repeats.

On XLA:CPU the per-call time of configs.small() has a large part that does not grow
with q: the capacity-padded ("tiled") MoE gathers one expert weight block per tile, and
the number of tiles G (column "MoE tiles") stays ~130-145 for power-of-two q; chunks whose
q is not a power of two get smaller tiles and ~1.45x more of them (q = 192, 384: G = 200,
204), which no smooth cost(q, c) captures. The grid therefore uses power-of-two chunks,
as a scheduler aligning chunks to tiles would.

Run: .venv/bin/python benchmarks/calibrate_cost.py [--repeats 5]   (~2-3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import time

import jax

import pdjax
from pdjax import analysis as A
from pdjax.model import moe as moe_lib

jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               ".jax_cache"))

FIT = [(64, 0), (128, 0), (256, 0), (512, 0), (64, 128), (128, 256), (256, 512), (512, 1024)]
HELD_OUT = [(64, 64), (128, 128), (256, 256), (512, 512)]


def moe_tiles(cfg, q: int) -> int:
    """Tiles the capacity-padded MoE runs for a chunk of q tokens (batch 1)."""
    assignments, experts = q * cfg.num_experts_per_tok, cfg.n_routed_experts
    return moe_lib.num_tiles(assignments, experts, moe_lib.tile_rows(assignments, experts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    cfg = pdjax.configs.small()
    params = pdjax.init_params(cfg, jax.random.key(0))
    result = A.calibrate(params, cfg, FIT, repeats=args.repeats, holdout=HELD_OUT,
                         seed=args.seed)
    elapsed = time.perf_counter() - t0

    print(f"calibrate_cost: configs.small() ({cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}), "
          f"batch 1, backend {jax.default_backend()}, {args.repeats} interleaved repeats\n")
    variants = {(stat, icpt): result.refit(intercept=icpt, statistic=stat)
                for stat in ("median", "min") for icpt in (False, True)}
    best = variants[("median", True)]
    print("measured (median of repeats) vs predicted by the three-term fit and by the fit "
          "with a constant d")
    print(f"{'q':>5} {'c':>5} {'split':>9} {'MoE tiles':>9} {'measured ms':>12} "
          f"{'3-term ms':>10} {'err':>6} {'+d ms':>9} {'err':>6} {'max/min':>8}")
    for r3, rd in zip(result.rows(), best.rows()):
        print(f"{r3['q']:>5} {r3['c']:>5} {r3['split']:>9} {moe_tiles(cfg, r3['q']):>9} "
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
    print(f"total runtime {elapsed:.0f} s")


if __name__ == "__main__":
    main()
