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

Beside the measurement, the cost model's prediction of the slope (step time per context token
beyond k): per cached token and layer, V3's dense absorbed attention does 2 H (2 C + R) FLOPs
and reads its (C + R)-value row, V3.2's indexer 2 Hi Di FLOPs and reads its Di-value key and
writes and reads one float32 logit (``pdjax.analysis.sparse_attention``, rows of
``pdjax.analysis.kv.kv_row_bytes`` in float32, the benchmark's cache), each timed by a
roofline of this machine: max(FLOPs / GEMM rate, bytes / read bandwidth), the float32 GEMM
rate (1024^3) and the read bandwidth (a sum over 256 MiB) measured by XLA in the same process,
best of 5. The measured slope is a least-squares line through the lengths >= k; the ratio
V3.2 / V3 of the two slopes is printed measured, predicted, and measured / predicted.

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


def _best(fn, repeats: int) -> float:
    fn()                                                          # compile, warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine(repeats: int = 5) -> tuple[float, float]:
    """(read bandwidth in B/s, float32 GEMM rate in FLOP/s) of this machine, measured by XLA."""
    x = jnp.ones((64 << 20,), jnp.float32)                       # 256 MiB
    total = jax.jit(jnp.sum)
    bw = x.nbytes / _best(lambda: total(x).block_until_ready(), repeats)
    a = jnp.ones((1024, 1024), jnp.float32)
    dot = jax.jit(jnp.dot)
    return bw, 2 * 1024 ** 3 / _best(lambda: dot(a, a).block_until_ready(), repeats)


def predicted_slopes(bw: float, flops: float) -> dict:
    """Seconds per context token (all layers) beyond k: {"v3": V3's dense absorbed attention,
    "v32": V3.2's indexer}, each (seconds, FLOPs, bytes, bound) a roofline of pdjax's per-token
    counts (see the module docstring; V3.2's attention is flat there)."""
    from pdjax.analysis.kv import kv_row_bytes
    from pdjax.analysis.sparse_attention import attention_flops_per_pair, sparse_work
    k, row = V32.index_topk, kv_row_bytes(V32, "uniform", 4)
    near, far = sparse_work(V32, [(1, 2 * k)], row), sparse_work(V32, [(1, 3 * k)], row)
    assert far.attention_flops == near.attention_flops and far.attention_bytes == near.attention_bytes
    per_token = {"v3": (attention_flops_per_pair(V3), kv_row_bytes(V3, "uniform", 4)["mla"]),
                 "v32": ((far.indexer_flops - near.indexer_flops) / k, (far.indexer_bytes - near.indexer_bytes) / k)}
    out = {}
    for name, (f, b) in per_token.items():
        cfg = V3 if name == "v3" else V32
        out[name] = (cfg.num_hidden_layers * max(f / flops, b / bw), f, b, "compute" if f / flops > b / bw else "memory")
    return out


def slope(lengths, times) -> float:
    """Least-squares slope of ``times`` against ``lengths``."""
    mx, my = sum(lengths) / len(lengths), sum(times) / len(times)
    return sum((x - mx) * (y - my) for x, y in zip(lengths, times)) / sum((x - mx) ** 2 for x in lengths)


def compare(t: dict, lengths, batch: int, bw: float, flops: float) -> None:
    """Print the measured slopes beyond k (per sequence of the batch) against the cost model's
    (see the module docstring)."""
    beyond = [L for L in sorted(lengths) if L >= V32.index_topk]
    if len(beyond) < 2:
        print(f"\n(the slope needs two lengths >= index_topk = {V32.index_topk})")
        return
    pred = predicted_slopes(bw, flops)
    meas = {m: slope(beyond, [t[(m, L)] * 1e-3 / batch for L in beyond]) for m in ("v3", "v32")}
    print(f"\ncost model: a roofline of this machine, read bandwidth {bw / 1e9:.1f} GB/s, float32 GEMM "
          f"{flops / 1e9:.1f} GFLOP/s; per context token and layer: V3's attention {pred['v3'][1]:,.0f} FLOP, "
          f"{pred['v3'][2]:,.0f} B ({pred['v3'][3]}-bound), V3.2's indexer {pred['v32'][1]:,.0f} FLOP, "
          f"{pred['v32'][2]:,.0f} B ({pred['v32'][3]}-bound)")
    print(f"slope over contexts {beyond} (ns per context token of a sequence, all layers):\n")
    print("| | V3 | V3.2 | V3.2 / V3 |\n|---|---|---|---|")
    rm, rp = meas["v32"] / meas["v3"], pred["v32"][0] / pred["v3"][0]
    print(f"| measured | {meas['v3'] * 1e9:.1f} | {meas['v32'] * 1e9:.1f} | {rm:.3f} |")
    print(f"| predicted | {pred['v3'][0] * 1e9:.1f} | {pred['v32'][0] * 1e9:.1f} | {rp:.3f} |")
    print(f"| measured / predicted | {meas['v3'] / pred['v3'][0]:.2f} | {meas['v32'] / pred['v32'][0]:.2f} | "
          f"{rm / rp:.2f} |")


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
    compare(t, args.lengths, args.batch, *machine())


if __name__ == "__main__":
    main()
