"""The one-call GPU suite: one table of what pdjax achieves on the GPU it runs on.

Rows (docs/model.md, "GPU suite", says what each means):

* ``mla``: the attention half of DeepSeek-V3 decoder layers in a decode step (RMSNorm,
  projections, absorbed MLA over a [B, S, C+R] latent cache, the new row written in place),
  achieved HBM bandwidth / the device's peak (target >= 70 %). Ideal bytes: every attention
  weight once, every cached row once, the new rows written, the activations in and out.
* ``gemm``: the routed experts' grouped GEMM (three ``ragged_dot`` and the SwiGLU,
  ``pdjax.model.moe``'s ragged back end) at DeepSeek-V3's expert shapes, balanced routing,
  TFLOP/s / the device's dense bf16 peak (target >= 60 %); ideal FLOPs 6 A D F for A rows.
  A second row runs the whole routed-expert path (sort, permute, GEMMs, weighted sum).
* ``ep``: a DeepSeek-V3 MoE layer through expert parallelism on a one-device mesh, the
  dropless ragged path (``ragged_all_to_all`` + ``ragged_dot``) against the padded
  dropless path; ms each and their ratio.
* ``model``: prefill and decode tokens/s of DeepSeek-V2-Lite (15.7 B params, bf16: one GPU),
  decode as a Python loop of ``pdjax.decode_step`` feeding back the argmax on the device, and
  how many of its steps the loop issued before the first one was done.

Peaks come from the ``pdjax.analysis`` hardware preset matching ``jax.devices()[0].device_kind``
(or ``--hardware``); ideals are computed from the configs. Every time is a median of
``block_until_ready`` timings after a compile-and-warm-up call. Each section runs in its own
process under a hard time limit (killed, its row marked, when over), so the whole run stays
under 8 minutes; ``--quick`` uses smaller shapes. On a machine without a GPU the suite says
so, measures nothing and exits 0.

Run: .venv/bin/python benchmarks/gpu_suite.py [--quick] [--hardware h200] [--only mla,gemm]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pdjax
from pdjax.analysis import hardware
from pdjax.model import mla
from pdjax.model import moe as moe_lib
from pdjax.model import transformer

#: device_kind substring -> pdjax.analysis hardware preset (first match wins).
DEVICE_PRESETS = (("GB200", "gb200"), ("H200", "h200"), ("H800", "h800"), ("H100", "h100-sxm"),
                  ("A100", "a100"), ("MI300X", "mi300x"))
#: seconds each section may take, compile included (killed past it); they sum to 7 minutes.
BUDGET_S = {"mla": 75, "gemm": 75, "ep": 90, "model": 180}
SECTIONS = tuple(BUDGET_S)
#: per section: full shapes, then --quick shapes.
SHAPES = {
    "mla": ({"batch": 64, "context": 8192, "layers": 4}, {"batch": 32, "context": 2048, "layers": 2}),
    "gemm": ({"experts": 32, "rows_per_expert": 2048}, {"experts": 32, "rows_per_expert": 512}),
    "ep": ({"tokens": 4096, "experts": 256}, {"tokens": 1024, "experts": 64}),
    "model": ({"prefill_batch": 4, "prompt": 2048, "decode_batch": 64, "context": 1024, "steps": 32},
              {"prefill_batch": 2, "prompt": 512, "decode_batch": 16, "context": 256, "steps": 16}),
}


def preset_for(device_kind: str):
    """The hardware preset name for a jax ``device_kind`` ("NVIDIA H200" -> "h200"), or None.
    PCIe parts have other peaks than the SXM presets: None."""
    kind = device_kind.upper()
    if "PCIE" in kind:
        return None
    return next((name for key, name in DEVICE_PRESETS if key in kind), None)


def bf16(cfg):
    return cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ---- the measured programs: (jitted function, make(key) -> its arguments, ideal) -------------

def mla_decode(cfg, batch: int, context: int, layers: int):
    """``layers`` attention halves of a decode step, one new token per row after ``context - 1``
    cached ones. Returns (run, make, ideal bytes); run(layer_params, x, caches, start) donates
    and returns the caches."""
    D, L = cfg.hidden_size, cfg.kv_latent_dim
    dtype, cache_dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.kv_cache_dtype)

    def make(key):
        ks = jax.random.split(key, 2 * layers + 1)
        lps = [{"attn_norm": jnp.ones((D,), dtype), "attn": mla.init_attention(cfg, k, dtype)}
               for k in ks[:layers]]
        caches = [jax.random.normal(k, (batch, context, L), jnp.float32).astype(cache_dtype)
                  for k in ks[layers:2 * layers]]
        x = jax.random.normal(ks[-1], (batch, 1, D), jnp.float32).astype(cfg.compute_dtype)
        return lps, x, caches, jnp.full((batch,), context - 1, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def run(lps, x, caches, start):
        out = []
        for lp, kv in zip(lps, caches):
            x, kv = transformer.attention_block(lp, cfg, x, start[:, None], kv, start, absorbed=True)
            out.append(kv)
        return x, out

    shapes = jax.eval_shape(make, jax.random.key(0))
    weights = _nbytes(shapes[0])
    act = 2 * batch * D * jnp.dtype(cfg.compute_dtype).itemsize                 # x in and out
    rows = layers * batch * L * cache_dtype.itemsize * (context + 1)            # read all, write one
    return run, make, weights + rows + act


def grouped_gemm(cfg, experts: int, rows_per_expert: int, whole_path: bool = False):
    """The ragged back end's expert FFN over ``experts`` experts with ``rows_per_expert`` rows
    each (``whole_path``: moe.routed_experts with top-k routing giving the same rows, sort and
    permutation included). Returns (run, make, ideal FLOPs)."""
    D, F, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    A = experts * rows_per_expert
    dtype = jnp.dtype(cfg.param_dtype)

    def make(key):
        kx, kw = jax.random.split(key)
        w = moe_lib.init_mlp(kw, D, F, dtype, leading=(experts,))
        if whole_path:
            N = A // k
            idx = (jnp.arange(N * k, dtype=jnp.int32) % experts).reshape(N, k)   # k distinct experts a token
            x = jax.random.normal(kx, (N, D), jnp.float32).astype(dtype)
            return w, x, jnp.full((N, k), 1.0 / k, jnp.float32), idx
        x = jax.random.normal(kx, (A, D), jnp.float32).astype(dtype)
        return w, x, jnp.full((experts,), rows_per_expert, jnp.int32)

    if whole_path:
        run = jax.jit(lambda w, x, weights, idx: moe_lib.routed_experts(w, x, weights, idx, "ragged"))
    else:
        run = jax.jit(lambda w, x, counts: moe_lib._experts_ragged(x, counts, w["w_gate"], w["w_up"],
                                                                   w["w_down"]))
    return run, make, 6 * A * D * F


def ep_layer(cfg, tokens: int, dispatch: str, platform: str | None = None):
    """One MoE layer (routing, routed and shared experts) through ExpertParallel on a one-device
    mesh with ``dispatch`` "ragged" or "padded" (dropless both), ragged_dot local experts.
    ``platform``: lower for it instead of the device's own (tests: "cuda" from a CPU host).
    Returns (run, make, None)."""
    from pdjax.parallel import ExpertParallel, ep_moe, make_mesh

    mesh = make_mesh({"data": 1, "expert": 1}, devices=jax.devices()[:1])
    ep = ExpertParallel(mesh, dispatch=dispatch, impl="ragged", target_platform=platform)
    dtype = jnp.dtype(cfg.param_dtype)

    def make(key):
        kp, kx = jax.random.split(key)
        return (moe_lib.init_moe(cfg, kp, dtype),
                jax.random.normal(kx, (tokens, cfg.hidden_size), jnp.float32).astype(cfg.compute_dtype))

    return jax.jit(lambda p, x: ep_moe(p, cfg, x, ep)), make, None


# ---- timing --------------------------------------------------------------------------------

def median_time(call, repeats: int, deadline: float) -> float:
    """Median seconds of ``call()`` (which blocks until its results are ready) over ``repeats``,
    fewer when ``deadline`` (time.monotonic) passes; the first call (compile) is not timed."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if time.monotonic() > deadline:
            break
    return statistics.median(times)


def run_section(name: str, quick: bool, hw, deadline: float) -> list[dict]:
    """Measure one section on the default device; rows of {row, shape, value, unit, of_peak, target}."""
    shape = SHAPES[name][quick]
    reps = 5 if quick else 10
    key = jax.random.key(0)
    rows = []
    if name == "mla":
        cfg = bf16(pdjax.configs.deepseek_v3())
        run, make, ideal = mla_decode(cfg, **shape)
        lps, x, caches, start = make(key)
        state = {"caches": caches}

        def call():
            _, state["caches"] = jax.block_until_ready(run(lps, x, state["caches"], start))
        t = median_time(call, reps, deadline)
        bw = ideal / t
        rows.append(dict(row="MLA decode, V3 attention halves", shape=_fmt(shape), value=bw / 1e12,
                         unit="TB/s", of_peak=bw / hw.hbm_bw if hw else None, target=0.70))
    elif name == "gemm":
        cfg = bf16(pdjax.configs.deepseek_v3())
        for whole, label in ((False, "MoE grouped GEMM (ragged_dot), V3 experts"),
                             (True, "routed experts incl. sort/permute")):
            run, make, flops = grouped_gemm(cfg, **shape, whole_path=whole)
            args = make(key)
            t = median_time(lambda: jax.block_until_ready(run(*args)), reps, deadline)
            rows.append(dict(row=label, shape=_fmt(shape), value=flops / t / 1e12, unit="TFLOP/s",
                             of_peak=flops / t / hw.peak_flops("bf16") if hw else None,
                             target=0.60 if not whole else None))
            del args
    elif name == "ep":
        cfg = bf16(pdjax.configs.deepseek_v3(n_routed_experts=shape["experts"]))
        ms = {}
        for dispatch in ("ragged", "padded"):
            row = f"EP MoE layer, 1 device, {dispatch} dropless"
            try:                      # one dispatch failing still leaves the other's row
                run, make, _ = ep_layer(cfg, shape["tokens"], dispatch)
                args = make(key)
                ms[dispatch] = 1e3 * median_time(lambda: jax.block_until_ready(run(*args)), reps, deadline)
                del args
            except Exception as e:
                rows.append(_error_row(row, e))
                continue
            rows.append(dict(row=row, shape=_fmt(shape), value=ms[dispatch], unit="ms", of_peak=None, target=None))
        if len(ms) == 2:
            rows.append(dict(row="EP ragged / padded time", shape=_fmt(shape), value=ms["ragged"] / ms["padded"],
                             unit="ratio", of_peak=None, target=None))
    elif name == "model":
        rows += _model_rows(shape, reps, deadline)
    return rows


def _model_rows(shape, reps, deadline) -> list[dict]:
    cfg = bf16(pdjax.configs.deepseek_v2_lite())
    params = pdjax.init_params(cfg, jax.random.key(0))
    rng = np.random.RandomState(0)
    B, T = shape["prefill_batch"], shape["prompt"]
    prompt = rng.randint(0, cfg.vocab_size, (B, T)).astype(np.int32)
    t = median_time(lambda: jax.block_until_ready(pdjax.prefill(params, cfg, prompt, moe_impl="ragged")),
                    max(3, reps // 2), deadline)
    rows = [dict(row="prefill, DeepSeek-V2-Lite bf16", shape=f"batch={B} prompt={T}", value=B * T / t,
                 unit="tokens/s", of_peak=None, target=None)]
    Bd, S, n = shape["decode_batch"], shape["context"], shape["steps"]
    prompt = rng.randint(0, cfg.vocab_size, (Bd, S)).astype(np.int32)
    logits, cache = pdjax.prefill(params, cfg, prompt, max_len=S + (reps + 2) * n + 1, moe_impl="ragged")
    state = {"tok": jnp.argmax(logits[:, -1], -1), "cache": cache}
    del logits

    def steps():
        tok, cache = state["tok"], state["cache"]
        for _ in range(n):
            step, cache = pdjax.decode_step(params, cfg, tok, cache, moe_impl="ragged")
            tok = jnp.argmax(step, -1)
        state.update(tok=jax.block_until_ready(tok), cache=cache)
    t = median_time(steps, reps, deadline)
    rows.append(dict(row="decode (decode_step loop), V2-Lite bf16", shape=f"batch={Bd} context={S}",
                     value=Bd * n / t, unit="tokens/s", of_peak=None, target=None))
    tok, cache, first, ahead = state["tok"], state["cache"], None, n
    for i in range(n):                      # how far the loop runs ahead of the device
        step, cache = pdjax.decode_step(params, cfg, tok, cache, moe_impl="ragged")
        tok = jnp.argmax(step, -1)
        if first is None:
            first = step
        elif ahead == n and first.is_ready():
            ahead = i
    jax.block_until_ready(tok)
    rows.append(dict(row="decode steps issued before step 1 was done", shape=f"of {n} (benchmarks/decode_dispatch.py)",
                     value=ahead, unit="steps", of_peak=None, target=None))
    return rows


def _error_row(row: str, e: Exception) -> dict:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return dict(row=row, shape="", value=None, unit="", of_peak=None, target=None, error=f"{type(e).__name__}: {first}")


def _fmt(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


# ---- the driver ----------------------------------------------------------------------------

def _child(name: str, quick: bool, hw_name: str | None, budget: float):
    """Run one section in this process and print its rows as one JSON line."""
    hw = hardware(hw_name) if hw_name else None
    try:
        rows = run_section(name, quick, hw, time.monotonic() + 0.6 * budget)
    except Exception as e:          # one failing section must not cost the others their rows
        rows = [_error_row(name, e)]
    print("ROWS " + json.dumps(rows), flush=True)


def _run_child(name: str, args, hw_name, env) -> list[dict]:
    budget = BUDGET_S[name] * (0.5 if args.quick else 1.0)
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--budget", str(budget)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--hardware", hw_name] if hw_name else []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, env=env)   # SIGKILL when over
    except subprocess.TimeoutExpired:
        return [dict(row=name, shape="", value=None, unit="", of_peak=None, target=None,
                     error=f"over its {budget:.0f} s budget: killed")]
    for line in out.stdout.splitlines():
        if line.startswith("ROWS "):
            return json.loads(line[5:])
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return [dict(row=name, shape="", value=None, unit="", of_peak=None, target=None,
                 error=f"exit {out.returncode}: {tail}")]


def print_table(rows, device: str, hw_name) -> None:
    print(f"## pdjax GPU suite on {device} (peaks: {hw_name or 'no preset: ratios not computed'})")
    print(f"| {'row':<42} | {'shape':<58} | {'value':>10} | {'unit':<8} | {'of peak':>7} | {'target':<8} |")
    print(f"|{'-' * 44}|{'-' * 60}|{'-' * 12}|{'-' * 10}|{'-' * 9}|{'-' * 10}|")
    for r in rows:
        if r.get("error"):
            print(f"| {r['row']:<42} | {'not measured: ' + r['error']:<58} | {'':>10} | {'':<8} | {'':>7} | {'':<8} |")
            continue
        peak = f"{100 * r['of_peak']:.0f} %" if r["of_peak"] is not None else "-"
        target = f">= {100 * r['target']:.0f} %" if r["target"] is not None else ""
        print(f"| {r['row']:<42} | {r['shape']:<58} | {r['value']:>10.4g} | {r['unit']:<8} | {peak:>7} | "
              f"{target:<8} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, half the time budgets")
    ap.add_argument("--hardware", help="pdjax.analysis hardware preset for the peaks (default: "
                                       "from jax.devices()[0].device_kind)")
    ap.add_argument("--only", help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)      # a child process
    ap.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hardware:
        hardware(args.hardware)                       # an unknown name: ValueError listing the presets
    sections = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; known: {SECTIONS}")
    if args.section:
        _child(args.section, args.quick, args.hardware, args.budget)
        return 0
    # this process only looks at the device: leave its memory to the section processes
    child_env = dict(os.environ)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"gpu_suite: no GPU here (jax.devices()[0] is {device.platform.upper()}: {device.device_kind}); "
              f"nothing measured. Run it on a machine with a CUDA GPU.")
        return 0
    hw_name = args.hardware or preset_for(device.device_kind)
    t0 = time.monotonic()
    rows = []
    for name in sections:
        rows += _run_child(name, args, hw_name, child_env)
    print_table(rows, f"{device.device_kind} (jax {jax.__version__})", hw_name)
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
