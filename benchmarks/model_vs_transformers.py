"""pdjax vs the transformers DeepseekV3 implementation (PyTorch) on CPU, side by side.

    python benchmarks/model_vs_transformers.py [--config small|wide|both] [--dtype f32|bf16]
        [--batch 8 --prompt 256 --steps 32 --repeats 5]

Configs (``--config both``, the default, runs them one after the other):
  * ``small``: ``pdjax.configs.small()`` (8 layers, hidden 512, 16 routed experts top-2 in 4
    groups (2 kept), 1 shared, MLA with q LoRA 256 / kv LoRA 128, vocab 4096, first layer dense);
  * ``wide``: ``configs.small`` with hidden 1024, dense intermediate 2048, 64 routed experts
    top-6 in 8 groups (4 kept), 2 shared, 4 layers (3 MoE; fewer layers keep the two copies of
    its weights within a shared machine's memory).
``--dtype bf16``: pdjax with ``param_dtype = compute_dtype = bfloat16`` (its float32 islands:
norms, RoPE, scores/softmax, router, expert combine, logits), transformers loaded in
torch.bfloat16. The bf16 sides round differently, so their agreement is printed, not judged.

Both sides run the *same* random weights: pdjax params from ``pdjax.init_params`` are written
with ``pdjax.save_hf`` into a temp dir and loaded by ``AutoModelForCausalLM.from_pretrained``.
Before timing, the script checks the two agree (logits of a short prompt, and the greedy
tokens of the benchmark run itself).

Timed (warm-up excluded: pdjax compiles once, torch runs once; medians over ``--repeats``,
the two sides interleaved within each repeat so machine noise hits both alike):
  * prefill: batch x prompt tokens, full logits, cache filled
    (pdjax.prefill / model(ids, use_cache=True));
  * decode step: per step over ``--steps`` greedy steps after that prefill, each step's argmax
    fed back (a Python loop of pdjax.decode_step / model(tok, cache=..., use_cache=True));
  * generate: pdjax.generate (prefill + fused lax.scan decode loop) and
    model.generate(do_sample=False, min/max_new_tokens=steps+1), reported per decode step as
    (generate total - prefill median) / steps.

Targets (issue 14): pdjax prefill tokens/s >= 1.5 x transformers' (prefill ms ratio <= 1/1.5),
decode ms/step <= 0.4 x transformers'.

The transformers side needs the optional extra ``pip install -e .[torch]`` (torch==2.13.0 CPU
and transformers). Without it only the pdjax side is printed, with a note, and the script
exits 0. Thread counts: both sides use the N cores this process may run on: XLA:CPU sizes its
pool to them, torch.set_num_threads(N); ``--threads K`` pins the process to K cores first.
OMP_WAIT_POLICY defaults to PASSIVE here (see below), which keeps torch from collapsing when
the cores are shared with other processes.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="greedy decode steps after prefill")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both sides (default: cores available to this process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers side")
    ap.add_argument("--config", choices=("small", "wide", "both"), default="both")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--no-generate", action="store_true",
                    help="skip the generate rows (pdjax.generate / model.generate)")
    return ap.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS and ARGS.threads and hasattr(os, "sched_setaffinity"):
    # Pin the process to that many cores before jax starts: XLA:CPU sizes its thread pool
    # to the cores it may run on, and torch gets the same count below.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: ARGS.threads])
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
# torch's OpenMP threads spin at barriers by default; on a machine shared with other work a
# descheduled thread then stalls the others, measured 4-5x slower prefill with 2 threads than
# with 1. Passive waiting removes that (set before torch is imported; an explicit setting wins).
OMP_POLICY_SET = "OMP_WAIT_POLICY" not in os.environ
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402

LOGIT_TOL = 1e-3          # float32 only; bf16 agreement is printed, not judged
PREFILL_TARGET = 1.5      # pdjax tokens/s >= 1.5 x transformers'
DECODE_TARGET = 0.4       # pdjax ms/step <= 0.4 x transformers'


def make_config(name: str, dtype: str):
    """The benchmark configs (see the module docstring), in float32 or bfloat16."""
    if name == "small":
        cfg = pdjax.configs.small()
    elif name == "wide":
        cfg = pdjax.configs.small(hidden_size=1024, intermediate_size=2048, n_routed_experts=64,
                                  num_experts_per_tok=6, n_shared_experts=2, n_group=8, topk_group=4,
                                  num_hidden_layers=4)
    else:
        raise ValueError(f"unknown config {name!r}; use 'small' or 'wide'")
    if dtype == "bf16":
        cfg = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    elif dtype != "f32":
        raise ValueError(f"unknown dtype {dtype!r}; use 'f32' or 'bf16'")
    return cfg


def _now():
    return time.perf_counter()


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


# ---- pdjax side ---------------------------------------------------------------------------

class PdjaxSide:
    def __init__(self, params, cfg, tokens, steps):
        self.params, self.cfg, self.tokens, self.steps = params, cfg, tokens, steps
        self.max_len = tokens.shape[1] + steps + 1
        self._argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))

    def prefill(self):
        logits, cache = pdjax.prefill(self.params, self.cfg, self.tokens, max_len=self.max_len)
        jax.block_until_ready((logits, cache))
        return logits, cache

    def prefill_decode(self):
        """Returns (prefill s, decode loop s, tokens [B, 1+steps])."""
        t0 = _now()
        logits, cache = self.prefill()
        t1 = _now()
        tok = self._argmax(logits[:, -1])
        out = [tok]
        for _ in range(self.steps):
            logits, cache = pdjax.decode_step(self.params, self.cfg, tok, cache)
            tok = self._argmax(logits)
            out.append(tok)
        out = np.stack([np.asarray(t) for t in jax.block_until_ready(out)], axis=1)
        t2 = _now()
        return t1 - t0, t2 - t1, out

    def generate(self):
        t0 = _now()
        out = pdjax.generate(self.params, self.cfg, self.tokens, max_new_tokens=self.steps + 1)
        t1 = _now()
        return t1 - t0, np.asarray(out)[:, self.tokens.shape[1]:]


# ---- transformers side ---------------------------------------------------------------------

class TorchSide:
    def __init__(self, model, tokens, steps):
        import inspect
        import torch

        self.torch, self.model, self.steps = torch, model, steps
        self.ids = torch.from_numpy(np.asarray(tokens, np.int64))
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def _cache_of(self, out):
        c = getattr(out, "cache", None)
        return c if c is not None else out.past_key_values

    def prefill_decode(self):
        torch = self.torch
        with torch.inference_mode():
            t0 = _now()
            out = self.model(self.ids, use_cache=True)
            t1 = _now()
            cache = self._cache_of(out)
            tok = out.logits[:, -1].argmax(-1)
            toks = [tok]
            for _ in range(self.steps):
                out = self.model(tok[:, None], use_cache=True, **{self.cache_kw: cache})
                cache = self._cache_of(out)
                tok = out.logits[:, -1].argmax(-1)
                toks.append(tok)
            t2 = _now()
        return t1 - t0, t2 - t1, torch.stack(toks, 1).numpy()

    def generate(self):
        torch = self.torch
        n = self.steps + 1
        with torch.inference_mode():
            t0 = _now()
            out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids),
                                      do_sample=False, min_new_tokens=n, max_new_tokens=n,
                                      pad_token_id=0, eos_token_id=None)
            t1 = _now()
        return t1 - t0, out[:, self.ids.shape[1]:].numpy()


def load_transformers(params, cfg, tmp):
    """(model, note): the same weights through save_hf -> from_pretrained, or (None, why).
    The model is loaded in the params' dtype (float32 or bfloat16)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed"
        return None, f"{type(e).__name__}: {e}"
    torch.set_num_threads(THREADS)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.param_dtype]
    pdjax.save_hf(tmp, params, cfg)
    path = os.path.join(tmp, "config.json")
    with open(path) as f:
        hf_cfg = json.load(f)
    added = []
    for k, v in {"architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": cfg.param_dtype,
                 "hidden_act": "silu", "attention_bias": False, "rope_interleave": True}.items():
        if k not in hf_cfg:
            hf_cfg[k] = v
            added.append(k)
    with open(path, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch_dtype, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers did not load the pdjax checkpoint cleanly: {bad}")
    model.eval()
    note = (f"{type(model).__name__} in {torch_dtype}, attn={model.config._attn_implementation}, "
            f"experts={getattr(model.config, '_experts_implementation', 'n/a')}; "
            f"added to the temp config.json: {', '.join(added) or 'nothing'}")
    return model, note


def versions() -> str:
    import jaxlib

    parts = [f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"]
    for mod in ("torch", "transformers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - optional extra
            parts.append(f"{mod} not installed")
    return ", ".join(parts)


# ---- main ----------------------------------------------------------------------------------

def _fmt_ms(s):
    return f"{s * 1e3:10.2f}" if s == s else f"{'-':>10}"


def describe(name, cfg):
    return (f"{name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} "
            f"experts top-{cfg.num_experts_per_tok}, {cfg.n_shared_experts} shared, "
            f"{cfg.param_dtype} params / {cfg.compute_dtype} compute")


def run_config(name, args):
    """Benchmark one config; returns {"prefill": ratio, "decode": ratio} (None without torch)."""
    cfg = make_config(name, args.dtype)
    B, T, N = args.batch, args.prompt, args.steps
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    params = pdjax.init_params(cfg, jax.random.key(args.seed))
    bf16 = cfg.compute_dtype != "float32"

    print(f"### {describe(name, cfg)}; batch {B}, prompt {T}, {N} greedy decode steps, "
          f"median of {args.repeats} interleaved repeats")
    tmp = tempfile.mkdtemp(prefix="pdjax_vs_hf_")
    model, note = (None, "--no-torch given") if args.no_torch else load_transformers(params, cfg, tmp)
    try:
        if model is None:
            print(f"NOTE: transformers side skipped ({note}); install the optional extra "
                  f"`pip install -e .[torch]` to compare. Printing pdjax only.")
        else:
            print(f"transformers: {note}")
        pj = PdjaxSide(params, cfg, tokens, N)
        th = TorchSide(model, tokens, N) if model is not None else None
        ok_logits = ok_tokens = True

        # -- agreement check --------------------------------------------------------------
        if th is not None:
            import torch
            short = tokens[:2, :16]
            lj = np.asarray(pdjax.forward(params, cfg, short))
            with torch.inference_mode():
                lt = model(torch.from_numpy(short.astype(np.int64))).logits.float().numpy()
            diff = float(np.abs(lj - lt).max())
            ok_logits = bf16 or diff < LOGIT_TOL
            verdict = "(bf16: printed, not judged)" if bf16 else (
                f"(tol {LOGIT_TOL:g}): {'OK' if ok_logits else 'MISMATCH'}")
            print(f"check: logits of a [2,16] prompt, max |pdjax - transformers| = {diff:.2e} "
                  f"(logit scale max |.| {float(np.abs(lt).max()):.2f}) {verdict}")

        # -- warm-up (compile / first run), also the greedy-token check ---------------------
        t = _now()
        _, _, pj_toks = pj.prefill_decode()
        pj_gen_toks = pj_toks if args.no_generate else pj.generate()[1]
        print(f"pdjax warm-up (compile prefill, decode_step{'' if args.no_generate else ', generate'}): "
              f"{_now() - t:.1f} s")
        same_pj = np.array_equal(pj_toks, pj_gen_toks)
        if th is not None:
            t = _now()
            _, _, th_toks = th.prefill_decode()
            th_gen_toks = th_toks if args.no_generate else th.generate()[1]
            print(f"transformers warm-up: {_now() - t:.1f} s")
            agree = int((pj_toks == th_toks).all(axis=1).sum())
            ok_tokens = bf16 or (np.array_equal(pj_toks, th_toks) and np.array_equal(th_toks, th_gen_toks)
                                 and same_pj)
            print(f"check: greedy tokens (1 from prefill + {N} decode steps, {B} rows): "
                  f"pdjax loop == pdjax.generate: {same_pj}; == transformers loop: "
                  f"{agree}/{B} rows identical; transformers loop == generate: "
                  f"{np.array_equal(th_toks, th_gen_toks)} -> "
                  f"{'printed, not judged (bf16)' if bf16 else ('OK' if ok_tokens else 'MISMATCH')}")
        else:
            print(f"check: pdjax decode_step loop tokens == pdjax.generate tokens: {same_pj}")

        # -- timing, interleaved (the side that goes first alternates) ---------------------
        r = {k: [] for k in ("pj_pre", "pj_dec", "pj_gen", "th_pre", "th_dec", "th_gen")}

        def time_pj():
            p, d, _ = pj.prefill_decode()
            r["pj_pre"].append(p)
            r["pj_dec"].append(d / N)

        def time_th():
            if th is not None:
                p, d, _ = th.prefill_decode()
                r["th_pre"].append(p)
                r["th_dec"].append(d / N)

        for i in range(args.repeats):
            for f in ((time_pj, time_th) if i % 2 == 0 else (time_th, time_pj)):
                f()
            if not args.no_generate:
                r["pj_gen"].append(pj.generate()[0])
                if th is not None:
                    r["th_gen"].append(th.generate()[0])
        m = {k: _median(v) for k, v in r.items()}
        pj_gen_step = (m["pj_gen"] - m["pj_pre"]) / N
        th_gen_step = (m["th_gen"] - m["th_pre"]) / N if th is not None else float("nan")

        def ratio(a, b):
            return f"{a / b:8.3f}" if th is not None and b == b and b > 0 else f"{'-':>8}"

        print()
        print(f"{'ms (median)':<44}{'pdjax':>10}{'transformers':>14}{'pdjax/tf':>10}")
        rows = [
            (f"prefill {B}x{T} (full logits, cache filled)", m["pj_pre"], m["th_pre"]),
            (f"decode step (loop of {N}, batch {B})", m["pj_dec"], m["th_dec"]),
        ]
        if not args.no_generate:
            rows += [
                (f"decode step via generate ((gen-prefill)/{N})", pj_gen_step, th_gen_step),
                (f"generate total (prefill + {N + 1} tokens)", m["pj_gen"], m["th_gen"]),
            ]
        for row, a, b in rows:
            print(f"{row:<44}{_fmt_ms(a)}    {_fmt_ms(b)}  {ratio(a, b)}")
        spread = {k: (min(v), max(v)) for k, v in r.items() if v}
        print("min..max ms: " + ", ".join(f"{k} {lo * 1e3:.1f}..{hi * 1e3:.1f}" for k, (lo, hi) in spread.items()))
        print(f"prefill tokens/s: pdjax {B * T / m['pj_pre']:.0f}"
              + (f", transformers {B * T / m['th_pre']:.0f}" if th is not None else "")
              + f"; decode tokens/s (batch {B}): pdjax loop {B / m['pj_dec']:.0f}"
              + (f", transformers loop {B / m['th_dec']:.0f}" if th is not None else ""))
        if th is None:
            print("targets not evaluated: no transformers side\n")
            return None
        pre = m["th_pre"] / m["pj_pre"]          # tokens/s ratio
        dec = m["pj_dec"] / m["th_dec"]
        print(f"target prefill tokens/s >= {PREFILL_TARGET} x transformers: {pre:.3f} "
              f"{'PASS' if pre >= PREFILL_TARGET else 'FAIL'}")
        line = f"target decode ms/step <= {DECODE_TARGET} x transformers: loop {dec:.3f} " \
               f"{'PASS' if dec <= DECODE_TARGET else 'FAIL'}"
        if not args.no_generate:
            g = pj_gen_step / th_gen_step
            line += f"; generate {g:.3f} {'PASS' if g <= DECODE_TARGET else 'FAIL'}"
        print(line)
        if not (ok_logits and ok_tokens):
            print("WARNING: the two sides disagree (see the checks above); timings compare different work")
        print()
        return {"prefill": pre, "decode": dec}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(args):
    names = ("small", "wide") if args.config == "both" else (args.config,)
    print(f"pdjax vs transformers DeepseekV3 on CPU, {args.dtype}, configs: {', '.join(names)}")
    print(f"versions: {versions()}; pdjax from {os.path.dirname(pdjax.__file__)}")
    print(f"threads: {THREADS} for both sides (cores in this process's affinity: XLA:CPU pool, "
          f"torch.set_num_threads({THREADS}), OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
          f"{' (set by this script)' if OMP_POLICY_SET else ''}); jax on {jax.devices()[0].platform}\n")
    results = {name: run_config(name, args) for name in names}
    if all(results.values()):
        print("summary: " + "; ".join(f"{n}: prefill tokens/s x{v['prefill']:.2f}, decode ms/step "
                                      f"x{v['decode']:.2f}" for n, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
