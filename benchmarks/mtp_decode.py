"""Benchmark: greedy decoding with and without MTP speculative decoding, on a trained model.

1. Train a small byte-level model with one MTP depth (``tiny`` widened and deepened, vocab
   256 = bytes; ``--width``, ``--layers``) on the Python standard library's own source: the
   sorted ``*.py`` files beside ``os.py``, concatenated, at most ``--corpus-mb`` MB; the last
   ``--holdout`` of it is kept out of training. Random windows of ``--seq`` bytes,
   ``pdjax.loss(..., mtp_weight=0.3)``, optax adamw (warm-up then cosine decay). The trained
   params go to ``--cache`` (an ``.npz`` with the config and training settings inside); a
   later run with the same settings loads them (``--retrain`` trains again).
2. For each batch size: prompts are held-out windows of ``--prompt`` bytes; ``pdjax.generate``
   with ``max_new_tokens=--new``, plain and ``speculative="mtp"``, each timed end to end
   (a warm-up call compiles first), interleaved over ``--repeats`` repeats:

   - ``accept``: accepted drafts / drafts verified; ``tok/step``: tokens per decode step;
   - ``tok/s plain`` / ``tok/s MTP``: batch * new tokens / median seconds;
   - ``speed-up``: the median over repeats of plain seconds / MTP seconds (both measured
     back to back in each repeat: the machine may be shared);
   - ``mismatch``: rows whose speculative tokens differ from the plain ones (should be 0).

The project's goal: accept rate >= 0.7 and decode tok/s >= 1.4x plain at batch 1.

    .venv/bin/python benchmarks/mtp_decode.py [--steps 600] [--width 96] [--layers 4]
        [--batches 1 8 32] [--new 64] [--repeats 5] [--retrain]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pdjax
from pdjax.experiments.results import markdown_table

MTP_WEIGHT = 0.3
COLUMNS = ("batch", "accept", "tok/step", "tok/s plain", "tok/s MTP", "speed-up", "mismatch")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- corpus ------------------------------------------------------------------------------

def corpus(max_mb: float) -> tuple[np.ndarray, list[str]]:
    """The standard library's top-level ``*.py`` files (sorted by name) as one uint8 array, cut
    at ``max_mb`` MB; (bytes, the file names used)."""
    root = os.path.dirname(os.__file__)
    parts, names, size = [], [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data + b"\n\n")
        names.append(os.path.basename(path))
        size += len(data) + 2
        if size >= max_mb * 2**20:
            break
    data = np.frombuffer(b"".join(parts), np.uint8)[: int(max_mb * 2**20)]
    return data.astype(np.int32), names


def split(data: np.ndarray, holdout: float) -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes): the last ``holdout`` fraction held out."""
    cut = int(len(data) * (1 - holdout))
    return data[:cut], data[cut:]


def windows(data: np.ndarray, rng, n: int, length: int) -> np.ndarray:
    """``n`` random windows [n, length] of ``data``."""
    starts = rng.integers(0, len(data) - length, n)
    return data[starts[:, None] + np.arange(length)[None, :]]


# ---- model and training ------------------------------------------------------------------

def config(width: int, layers: int):
    """``tiny`` scaled to hidden ``width`` and ``layers`` layers (the first dense), one MTP depth."""
    w = width
    return pdjax.configs.tiny(hidden_size=w, intermediate_size=2 * w, moe_intermediate_size=w // 2,
                              num_hidden_layers=layers, q_lora_rank=w // 2, kv_lora_rank=w // 2,
                              qk_nope_head_dim=w // 4, qk_rope_head_dim=w // 8, v_head_dim=w // 4,
                              num_nextn_predict_layers=1)


def optimizer(args):
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 2), args.steps,
                                               end_value=args.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def make_step(cfg, opt):
    """The jitted train step: (params, opt state, tokens) -> (params, opt state, loss)."""
    def step(params, state, tokens):
        value, grads = jax.value_and_grad(lambda p: pdjax.loss(p, cfg, tokens, mtp_weight=MTP_WEIGHT))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value
    return jax.jit(step, donate_argnums=(0, 1))


def eval_losses(params, cfg, tokens) -> tuple[float, float]:
    """(main CE, MTP depth-1 CE) on ``tokens``, in nats per byte."""
    main = float(pdjax.loss(params, cfg, tokens))
    both = float(pdjax.loss(params, cfg, tokens, mtp_weight=MTP_WEIGHT))
    return main, (both - main) / MTP_WEIGHT


def train(cfg, train_data, eval_tokens, args) -> tuple[dict, dict]:
    """Train from ``init_params(cfg, key(seed))``; (params, a summary of the run)."""
    rng = np.random.default_rng(args.seed)
    params = pdjax.init_params(cfg, jax.random.key(args.seed))
    opt = optimizer(args)
    state, step = opt.init(params), make_step(cfg, opt)
    t0 = time.perf_counter()
    recent = []
    for i in range(args.steps):
        params, state, value = step(params, state, windows(train_data, rng, args.batch, args.seq))
        recent.append(value)
        if i == 0:
            jax.block_until_ready(value)
            log(f"step 1 (compiles) {time.perf_counter() - t0:.1f} s, loss {float(value):.3f}")
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            mean = float(np.mean([float(v) for v in recent]))
            recent = []
            log(f"step {i + 1}/{args.steps}  train loss {mean:.3f}  {time.perf_counter() - t0:.0f} s")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    main, mtp_ce = eval_losses(params, cfg, eval_tokens)
    summary = {"train_s": round(seconds, 1), "heldout_main_ce": round(main, 4), "heldout_mtp_ce": round(mtp_ce, 4)}
    log(f"trained in {seconds:.0f} s: held-out main CE {main:.3f}, MTP CE {mtp_ce:.3f} nats/byte")
    return params, summary


# ---- the params cache --------------------------------------------------------------------

def settings(cfg, args, n_bytes: int) -> str:
    """What determines the trained params: compared with the cache's before loading it."""
    keys = ("steps", "batch", "seq", "lr", "warmup", "seed", "corpus_mb", "holdout")
    return json.dumps({"cfg": repr(cfg), "corpus_bytes": n_bytes, "python": sys.version.split()[0],
                       **{k: getattr(args, k) for k in keys}}, sort_keys=True)


def save(path: str, params, meta: str, summary: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    leaves = jax.tree.leaves(params)
    np.savez(path, meta=np.array(meta), summary=np.array(json.dumps(summary)),
             **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)})


def load(path: str, cfg, meta: str):
    """(params, summary) from the cache, or None if it is missing or holds other settings."""
    if not os.path.exists(path):
        return None
    with np.load(path) as f:
        if str(f["meta"]) != meta:
            log(f"{path}: trained with other settings; training again")
            return None
        like = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
        leaves, tree = jax.tree.flatten(like)
        params = tree.unflatten([jnp.asarray(f[f"leaf{i}"]) for i in range(len(leaves))])
        return params, json.loads(str(f["summary"]))


# ---- decoding ----------------------------------------------------------------------------

def timed(fn):
    """(result, seconds) of ``fn()``; the results are numpy, so the call has finished."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def measure(params, cfg, prompts: np.ndarray, args) -> dict:
    """One table row for the batch of ``prompts`` [B, T]."""
    B = prompts.shape[0]
    plain = lambda: pdjax.generate(params, cfg, prompts, max_new_tokens=args.new)             # noqa: E731
    spec = lambda: pdjax.generate(params, cfg, prompts, max_new_tokens=args.new,               # noqa: E731
                                  speculative="mtp", return_stats=True)
    ref, (out, stats) = plain(), spec()                                                        # compile
    times = []
    for _ in range(args.repeats):
        (_, tp), (_, ts) = timed(plain), timed(spec)
        times.append((tp, ts))
    tp, ts = np.median(times, axis=0)
    return {"batch": B, "accept": stats["accept_rate"], "tok/step": stats["tokens_per_step"],
            "tok/s plain": B * args.new / tp, "tok/s MTP": B * args.new / ts,
            "speed-up": float(np.median([p / s for p, s in times])),
            "mismatch": int(np.sum(np.any(ref != out, axis=1))), "steps": stats["steps"]}


def sample(params, cfg, prompt: np.ndarray, new: int) -> str:
    """A prompt and its greedy continuation, as text."""
    out = pdjax.generate(params, cfg, prompt[None], max_new_tokens=new)[0]
    text = lambda t: bytes(int(b) for b in t).decode("utf-8", "replace")                         # noqa: E731
    return f"{text(out[:len(prompt)])!r} -> {text(out[len(prompt):])!r}"


# ---- main --------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=96, help="hidden size (the other widths follow)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (the first dense)")
    ap.add_argument("--steps", type=int, default=600, help="training steps")
    ap.add_argument("--batch", type=int, default=32, help="training windows per step")
    ap.add_argument("--seq", type=int, default=128, help="training window length (bytes)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-mb", type=float, default=3.0)
    ap.add_argument("--holdout", type=float, default=0.05, help="fraction of the corpus held out")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--cache", default="runs/mtp_decode/params.npz")
    ap.add_argument("--retrain", action="store_true", help="train even if the cache matches")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (bytes)")
    ap.add_argument("--new", type=int, default=64, help="max_new_tokens")
    ap.add_argument("--repeats", type=int, default=5)
    return ap.parse_args()


def get_params(cfg, args, data):
    """Trained params and the training summary: from the cache, else trained (and cached)."""
    train_data, held = split(data, args.holdout)
    eval_tokens = windows(held, np.random.default_rng(args.seed + 1), 64, args.seq)
    meta = settings(cfg, args, len(data))
    cached = None if args.retrain else load(args.cache, cfg, meta)
    if cached is not None:
        log(f"loaded trained params from {args.cache}")
        return cached
    params, summary = train(cfg, train_data, eval_tokens, args)
    save(args.cache, params, meta, summary)
    log(f"saved {args.cache}")
    return params, summary


def main():
    args = parse_args()
    data, names = corpus(args.corpus_mb)
    cfg = config(args.width, args.layers)
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))))
    print(f"corpus: {len(data) / 2**20:.2f} MB of Python {sys.version.split()[0]}'s stdlib ({len(names)} files, "
          f"{names[0]} .. {names[-1]}), last {args.holdout:.0%} held out; {os.cpu_count()} cores, "
          f"{jax.default_backend()}")
    print(f"model: tiny(hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} "
          f"experts top-{cfg.num_experts_per_tok}, 1 MTP depth), {n_params:,} params; training: {args.steps} "
          f"steps x {args.batch} x {args.seq} bytes, adamw lr {args.lr:g} (cosine), mtp_weight {MTP_WEIGHT}")
    params, summary = get_params(cfg, args, data)
    print(f"training: {summary['train_s']:.0f} s; held-out CE: main {summary['heldout_main_ce']:.3f}, "
          f"MTP depth 1 {summary['heldout_mtp_ce']:.3f} nats/byte")
    _, held = split(data, args.holdout)
    prompts = windows(held, np.random.default_rng(args.seed + 2), max(args.batches), args.prompt)
    rows = []
    for B in args.batches:
        rows.append(measure(params, cfg, prompts[:B], args))
        log(f"batch {B}: {rows[-1]}")
    print(f"\ndecode: prompts of {args.prompt} held-out bytes, {args.new} new tokens, greedy; "
          f"medians of {args.repeats} interleaved repeats\n")
    print(markdown_table(rows, columns=COLUMNS))
    r1 = next((r for r in rows if r["batch"] == 1), None)
    if r1 is not None:
        met = r1["accept"] >= 0.7 and r1["speed-up"] >= 1.4
        print(f"\ngoal (batch 1: accept >= 0.7, speed-up >= 1.4x): accept {r1['accept']:.2f}, "
              f"speed-up {r1['speed-up']:.2f}x -> {'met' if met else 'not met'}")
    print(f"\nsample: {sample(params, cfg, prompts[0], args.new)}")


if __name__ == "__main__":
    main()
