"""Compile time against depth: per-layer params (a Python loop over layers) vs stacked params
(one ``lax.scan`` per run of same-kind layers, ``pdjax.stack_layers``).

A DeepSeek-V3-shaped config at small widths (the V3 preset's layer pattern and routing: the
first 3 layers dense, MoE after, sigmoid + bias top-8 of 32 experts in 8 groups, YaRN; hidden
512) at 4 and at 61 layers. For each of forward (B=2, T=128), a fresh prefill (B=2, T=128
into 256 positions) and decode_step (B=8, a 256-position cache) the jitted function is traced
and lowered (``.lower``, column ``lower s``), then compiled (``.compile()``, ``compile s``),
on abstract params (nothing is allocated), with the persistent compilation cache off and
``jax.clear_caches()`` before every measurement. Modes and depths are interleaved; each cell
is the median of ``--repeats`` runs. The ratio columns are the 61-layer time over the 4-layer
time of the same mode (target for the scan mode: compile <= 2.0).

``--run-layers N`` (default 8; 0 skips) also times the compiled programs of an N-layer model
of the same shape with real weights, both modes interleaved, medians of ``--run-repeats``:
what the scan costs at run time (on XLA:CPU each iteration copies its layer's weights, and in
a cached step its layer's cache rows, out of the stacked buffers: a dynamic slice feeding a
dot is materialised).

``--run-dtypes`` picks the run-time tables' precisions (default float32 and bfloat16).

Run: .venv/bin/python benchmarks/compile_time.py [--repeats 3] [--depths 4 61] [--run-layers 8]
     [--functions] (no compile-time table) [--run-dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import jax

jax.config.update("jax_enable_compilation_cache", False)

import jax.numpy as jnp  # noqa: E402

import pdjax  # noqa: E402
from pdjax.model import layer_scan, transformer  # noqa: E402
from pdjax.model.cache import init_cache  # noqa: E402


def v3_small(layers: int):
    """DeepSeek-V3's config with small widths and ``layers`` layers (3 dense first)."""
    return pdjax.configs.deepseek_v3(
        num_hidden_layers=layers, vocab_size=4096, hidden_size=512, intermediate_size=1024,
        moe_intermediate_size=256, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32)


def programs(cfg, mode: str):
    """name -> a thunk returning the lowered program (abstract inputs)."""
    init = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    if mode == "scan":
        params = jax.eval_shape(lambda p: layer_scan.stack_layers(p, cfg), init)
        cache = jax.eval_shape(lambda: layer_scan.init_stacked_cache(cfg, 8, 256))
    else:
        params, cache = init, jax.eval_shape(lambda: init_cache(cfg, 8, 256))
    i32 = jnp.int32
    tokens = jax.ShapeDtypeStruct((2, 128), i32)
    return {
        "forward": lambda: transformer._forward.lower(params, cfg, tokens, None),
        "prefill": lambda: transformer._prefill_fresh.lower(params, cfg, tokens, jax.ShapeDtypeStruct((2,), i32),
                                                            256, False, None),
        "decode_step": lambda: transformer._decode_step.lower(params, cfg, jax.ShapeDtypeStruct((8,), i32),
                                                              cache, None),
    }


def measure(cfg, mode: str, name: str) -> tuple[float, float]:
    jax.clear_caches()
    thunk = programs(cfg, mode)[name]
    t0 = time.perf_counter()
    lowered = thunk()
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def run_times(layers: int, repeats: int, dtype: str = "float32") -> dict:
    """mode -> name -> median ms of the compiled forward, fresh prefill and a decode step
    (params and compute in ``dtype``)."""
    cfg = v3_small(layers).replace(param_dtype=dtype, compute_dtype=dtype)
    params = jax.jit(pdjax.init_params, static_argnums=0)(cfg, jax.random.key(0))
    forms = {"layers": params, "scan": jax.jit(layer_scan.stack_layers, static_argnums=1)(params, cfg)}
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 128)), jnp.int32)
    lengths = jnp.full((2,), 128, jnp.int32)
    step_tokens = jnp.asarray(np.arange(8) % cfg.vocab_size, jnp.int32)
    caches = {}
    for mode, p in forms.items():          # warm up (compile) and make each mode's decode cache
        jax.block_until_ready(transformer._forward(p, cfg, tokens, None))
        jax.block_until_ready(transformer._prefill_fresh(p, cfg, tokens, lengths, 256, False, None))
        _, caches[mode] = pdjax.prefill(p, cfg, jnp.tile(tokens[:1], (8, 1)), max_len=256)
        (_, caches[mode]), _ = transformer._decode_step(p, cfg, step_tokens, caches[mode], None)
    times: dict = {}

    def timed(mode, name, f):
        t0 = time.perf_counter()
        out = jax.block_until_ready(f())
        times.setdefault(mode, {}).setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out
    steps = 4                               # decode steps per repeat (the cache holds 256 - 129)
    for _ in range(min(repeats, (256 - 129) // steps)):
        for mode, p in forms.items():
            timed(mode, "forward", lambda: transformer._forward(p, cfg, tokens, None))
            timed(mode, "prefill", lambda: transformer._prefill_fresh(p, cfg, tokens, lengths, 256, False, None))
            for _ in range(steps):
                (_, caches[mode]), _ = timed(mode, "decode_step",
                                             lambda: transformer._decode_step(p, cfg, step_tokens, caches[mode], None))
    return {mode: {name: statistics.median(v) for name, v in d.items()} for mode, d in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--depths", type=int, nargs=2, default=(4, 61))
    ap.add_argument("--functions", nargs="*", default=["forward", "prefill", "decode_step"],
                    help="the compile-time table's functions (none: no compile-time table)")
    ap.add_argument("--run-layers", type=int, default=8)
    ap.add_argument("--run-repeats", type=int, default=7)
    ap.add_argument("--run-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = ap.parse_args()
    shallow, deep = args.depths
    cfgs = {d: v3_small(d) for d in (shallow, deep)}
    runs = {d: [(r.start, r.stop - 1, "MoE" if r.moe else "dense") for r in layer_scan.layer_runs(cfgs[d])]
            for d in cfgs}
    print(f"layer runs: {runs}")
    times: dict = {}
    for _ in range(args.repeats if args.functions else 0):
        for name in args.functions:
            for depth in (shallow, deep):
                for mode in ("layers", "scan"):
                    times.setdefault((name, mode, depth), []).append(measure(cfgs[depth], mode, name))
    if args.functions:
        print(f"\n| function | mode | lower s ({shallow}) | lower s ({deep}) | lower {deep}/{shallow} "
              f"| compile s ({shallow}) | compile s ({deep}) | compile {deep}/{shallow} |")
        print("|---|---|---|---|---|---|---|---|")
    for name in args.functions:
        for mode in ("layers", "scan"):
            lo = [statistics.median(t[i] for t in times[(name, mode, d)]) for i in (0,) for d in (shallow, deep)]
            co = [statistics.median(t[1] for t in times[(name, mode, d)]) for d in (shallow, deep)]
            label = "per-layer loop" if mode == "layers" else "scan (stacked)"
            print(f"| {name} | {label} | {lo[0]:.2f} | {lo[1]:.2f} | {lo[1] / lo[0]:.2f} "
                  f"| {co[0]:.2f} | {co[1]:.2f} | {co[1] / co[0]:.2f} |")
    if args.functions:
        print(f"\nmedian of {args.repeats}; target: scan compile {deep}/{shallow} <= 2.0")
    for dtype in args.run_dtypes if args.run_layers else ():
        ms = run_times(args.run_layers, args.run_repeats, dtype)
        print(f"\nrun time, {args.run_layers} layers, {dtype} params and compute (median of {args.run_repeats}; "
              "decode: batch 8, cache 256, 4 steps per repeat)\n")
        print("| ms | per-layer loop | scan (stacked) | scan / per-layer |")
        print("|---|---|---|---|")
        for name in ("forward", "prefill", "decode_step"):
            a, b = ms["layers"][name], ms["scan"][name]
            print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
