"""Bytes accessed by one ``decode_step`` (cache donated) over the ideal, across MLA shapes.

The ideal is every param read once plus the latent cache read once (``params + cache``
bytes; the B new cache rows written are left out, as are activations). The measurement is
XLA's cost analysis of the compiled public decode step (``pdjax.model.transformer._decode_step``,
the jitted core of ``pdjax.decode_step``; cache donated, default MoE back end); nothing is
allocated or run: params and cache are ``jax.ShapeDtypeStruct``s, so the 8K x 64 shapes
only compile.

Model: ``configs.small`` cut to 2 layers (one dense, one MoE) with the swept heads H and
kv_lora_rank C, rope 16; cache length S and batch B swept; float32, and bf16 params +
compute (+ cache, which follows the compute dtype). Target: <= 3.0 on every shape.

Run: .venv/bin/python benchmarks/mla_decode_traffic.py [--quick] [--dense] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

import pdjax
from pdjax.model import transformer as tr

HEADS, RANKS, LENGTHS, BATCHES = (4, 16, 128), (32, 128, 512), (256, 1024, 8192), (1, 8, 64)
TARGET = 3.0


def sweep_config(heads: int, kv_lora_rank: int, dtype: str = "float32", layers: int = 2, dense: bool = False):
    """``dense``: every layer a dense MLP (no MoE), so the table shows the attention's traffic."""
    return pdjax.configs.small(num_attention_heads=heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=16,
                               num_hidden_layers=layers, max_position_embeddings=max(LENGTHS),
                               param_dtype=dtype, compute_dtype=dtype,
                               first_k_dense_replace=layers if dense else 1)


def nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_traffic(cfg, batch: int, length: int) -> dict:
    """{"bytes": cost-analysis bytes accessed of one decode step, "params", "cache": bytes}."""
    params = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: pdjax.init_cache(cfg, batch, length))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    cost = tr._decode_step.lower(params, cfg, tokens, cache).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"bytes": cost["bytes accessed"], "params": nbytes(params), "cache": nbytes(cache.kv)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the corners of each axis")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), action="append")
    ap.add_argument("--dense", action="store_true", help="dense MLP layers only (no MoE)")
    args = ap.parse_args()
    dtypes = args.dtype or ["float32", "bfloat16"]
    pick = (lambda v: (v[0], v[-1])) if args.quick else (lambda v: v)
    shapes = list(itertools.product(pick(HEADS), pick(RANKS), pick(LENGTHS), pick(BATCHES)))
    print(f"## decode_step bytes accessed / (params + latent cache), 2-layer configs.small "
          f"({'dense MLPs' if args.dense else 'dense + MoE layer'}), rope 16, "
          f"XLA:{jax.default_backend()}, jax {jax.__version__}")
    print(f"{'H':>4}{'C':>5}{'S':>6}{'B':>4}" + "".join(f"{d + ' ideal MiB':>20}{d + ' ratio':>16}" for d in dtypes))
    worst = {d: (0.0, None) for d in dtypes}
    t0 = time.perf_counter()
    for H, C, S, B in shapes:
        row = f"{H:>4}{C:>5}{S:>6}{B:>4}"
        for d in dtypes:
            r = decode_traffic(sweep_config(H, C, d, dense=args.dense), B, S)
            ideal = r["params"] + r["cache"]
            ratio = r["bytes"] / ideal
            worst[d] = max(worst[d], (ratio, (H, C, S, B)))
            row += f"{ideal / 2**20:>20.1f}{ratio:>16.2f}"
        print(row, flush=True)
    for d, (ratio, shape) in worst.items():
        print(f"{d}: worst {ratio:.2f} at (H, C, S, B) = {shape}; target <= {TARGET}: "
              f"{'PASS' if ratio <= TARGET else 'FAIL'}")
    print(f"({len(shapes) * len(dtypes)} compiles, {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
