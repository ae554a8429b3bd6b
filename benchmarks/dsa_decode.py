"""Decode step time against the context length: DeepSeek-V3 (dense MLA) and DeepSeek-V3.2
(sparse attention: the indexer selects ``index_topk`` cached tokens per query) at equal
model size, on CPU.

Both models are ``configs.small()`` (8 layers, hidden 512, 8 heads, latent 128 + rope 32);
V3.2 adds an indexer in the released proportions (heads half of MLA's, 64 of 128; its key a
fifth of MLA's row, 128 of 576): 4 heads of width 32, selecting 256 tokens. Each context length L gets a cache
of exactly L + 1 positions filled with random latents (the step's cost does not depend on
their values) and a batch of ``--batch`` sequences at position L; a jitted decode step
(cache donated, tokens fed back on the device) is timed over ``--steps`` steps, the two
models alternating, median of ``--repeats``.

The attention's share is the step time less the step time at the shortest context (what
does not grow with it: the weights, the MoE): V3's grows linearly with L, V3.2's is the
indexer (linear at its small width: a 32-wide key and 4 scores per token against MLA's
160-wide row read by 8 heads)
and a sparse attention flat beyond 256 tokens.

Run: .venv/bin/python benchmarks/dsa_decode.py [--lengths 256 1024 4096 16384] [--batch 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

import pdjax
from pdjax.model.cache import KVCache
from pdjax.model.transformer import decode_core

V3 = pdjax.configs.small()
# the released proportions: indexer heads half of MLA's (64 of 128), its key a fifth of MLA's row (128 of 576)
V32 = V3.replace(index_n_heads=4, index_head_dim=32, index_topk=256, model_type="deepseek_v32")


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _step(params, cfg, tokens, cache):
    logits, cache = decode_core(params, cfg, tokens, cache)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), _rewind(cache)


def _rewind(cache: KVCache) -> KVCache:
    """The same cache, its lengths one back: every timed step decodes at the same position."""
    return KVCache(kv=cache.kv, lengths=cache.lengths - 1)


def _cache(cfg, batch: int, length: int, key) -> KVCache:
    kv = tuple(jax.random.normal(jax.random.fold_in(key, l), (batch, length + 1, cfg.kv_latent_dim), jnp.float32)
               for l in range(cfg.num_hidden_layers))
    return KVCache(kv=kv, lengths=jnp.full((batch,), length, jnp.int32))


def _time(params, cfg, cache, tokens, steps: int):
    tokens, cache = _step(params, cfg, tokens, cache)             # compile, warm
    jax.block_until_ready(tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens, cache = _step(params, cfg, tokens, cache)
    jax.block_until_ready(tokens)
    return (time.perf_counter() - t0) / steps * 1e3, cache


def measure(lengths, batch: int, steps: int, repeats: int) -> dict:
    """{(model, L): median step ms}."""
    key = jax.random.key(0)
    params = {name: pdjax.init_params(cfg, key) for name, cfg in (("v3", V3), ("v32", V32))}
    out = {}
    for L in lengths:
        caches = {"v3": _cache(V3, batch, L, key), "v32": _cache(V32, batch, L, key)}
        times = {"v3": [], "v32": []}
        tokens = jnp.zeros((batch,), jnp.int32)
        for _ in range(repeats):
            for name, cfg in (("v3", V3), ("v32", V32)):
                ms, caches[name] = _time(params[name], cfg, caches[name], tokens, steps)
                times[name].append(ms)
        for name in times:
            out[(name, L)] = statistics.median(times[name])
        print(f"  L={L}: v3 {out[('v3', L)]:.2f} ms, v3.2 {out[('v32', L)]:.2f} ms", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch {args.batch}; V3.2: index_topk "
          f"{V32.index_topk}, indexer {V32.index_n_heads} x {V32.index_head_dim}")
    t = measure(sorted(args.lengths), args.batch, args.steps, args.repeats)
    L0 = min(args.lengths)
    print("\n| context | V3 step ms | V3.2 step ms | V3.2 / V3 | V3 attention ms | V3.2 attention ms |")
    print("|---|---|---|---|---|---|")
    for L in sorted(args.lengths):
        a, b = t[("v3", L)], t[("v32", L)]
        print(f"| {L} | {a:.2f} | {b:.2f} | {b / a:.2f} | {a - t[('v3', L0)]:.2f} | {b - t[('v32', L0)]:.2f} |")


if __name__ == "__main__":
    main()
