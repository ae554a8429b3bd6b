"""Benchmark: how long the pipeline executor takes to start, against the unsplit model.

For every schedule the executor runs (2 ranks on 2 simulated CPU devices; the model of the
executor tests, ``tiny(num_hidden_layers=4, first_k_dense_replace=2)``, 4 micro-batches of
2 rows x 8 tokens; ``--scale`` multiplies the widths, rows and tokens), each measurement in a
fresh process (no compiled program carries over; the persistent compilation cache off):

- ``vag s``: the unsplit model's ``jax.jit(jax.value_and_grad(loss))`` first call (measured
  in a process of its own before and after the schedules; the mean);
- ``step s``: ``Executor.step``'s first call (tracing, compiling, running), and ``ratio``:
  step / vag (the goal: at most 2);
- ``trace s`` / ``XLA s``: jax's own trace and XLA compile durations during that first step
  (XLA s is summed over the compiling threads, so it can exceed the step), ``compiles``:
  XLA compiles in it (jax's count, the small ``jnp`` adds gathering the gradients included),
  ``programs``: stage programs the executor loads, ``distinct``: of those, the programs
  compiled as the first of their kind (the others run the same code on another device:
  relocated, or compiled again where XLA:CPU cannot serialize the program);
- ``compile() s``: in another fresh process, ``Executor.compile`` alone; then ``1st/10th``:
  the first step's makespan (its measured timeline) over the tenth's, and ``wall`` the same
  for the whole ``step`` call.

``--disk-cache`` adds ``cached s``: the first step in a fresh process whose persistent
compilation cache a previous process filled (what a user's second run pays).

    .venv/bin/python benchmarks/cold_start.py [--schedules 1f1b,zb1p] [--scale 1]
        [--threads N] [--disk-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SCHEDULES = ("1f1b", "zb1p", "dualpipe", "dualpipev", "interleaved-1f1b", "gpipe")
RANKS, MICROBATCHES, ROWS, T = 2, 4, 2, 8
_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


def _child_setup(cache_dir):
    """In the measuring process: devices, the cache, jax's compile events counted."""
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={RANKS}").strip()
    import jax
    from jax._src import monitoring

    jax.config.update("jax_enable_compilation_cache", cache_dir is not None)
    if cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    events = {k: [] for k in _EVENTS}
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: events[name].append(secs) if name in events else None)
    return events


def _model(scale: int):
    import jax
    import numpy as np

    import pdjax

    base = pdjax.configs.tiny(num_hidden_layers=4, first_k_dense_replace=2)
    fields = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank")
    cfg = base.replace(**{f: getattr(base, f) * scale for f in fields})
    params = jax.block_until_ready(pdjax.init_params(cfg, jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (MICROBATCHES * ROWS * scale, T * scale),
                                               dtype=np.int32)
    return cfg, params, tokens


def child(what: str, schedule: str, scale: int, cache_dir) -> dict:
    """One measurement in this (fresh) process; returns a dict printed as JSON."""
    events = _child_setup(cache_dir)
    import jax

    import pdjax
    import pdjax.pipeline as pp
    from pdjax.pipeline import compiled

    cfg, params, tokens = _model(scale)
    for v in events.values():
        v.clear()
    if what == "vag":
        f = jax.jit(jax.value_and_grad(pdjax.loss), static_argnums=1)
        t0 = time.perf_counter()
        jax.block_until_ready(f(params, cfg, tokens))
        return {"vag": time.perf_counter() - t0}
    ex = pp.Executor(pp.build(schedule, RANKS, MICROBATCHES), cfg, devices=jax.devices()[:RANKS])
    stats = dict(getattr(compiled, "STATS", {}))
    if what == "step":
        t0 = time.perf_counter()
        jax.block_until_ready(ex.step(params, tokens))
        out = {"step": time.perf_counter() - t0}
        out.update(trace=sum(events[_EVENTS[0]]), xla=sum(events[_EVENTS[1]]), compiles=len(events[_EVENTS[1]]))
        now = getattr(compiled, "STATS", {})
        out.update({k: now[k] - stats.get(k, 0) for k in now})
        return out
    t0 = time.perf_counter()
    ex.compile(params, tokens.shape)
    out = {"compile": time.perf_counter() - t0}
    walls, spans = [], []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(ex.step(params, tokens))
        walls.append(time.perf_counter() - t0)
        spans.append(ex.last_timeline.makespan)
    out.update(span_ratio=spans[0] / spans[-1], wall_ratio=walls[0] / walls[-1], span_first_ms=spans[0],
               span_tenth_ms=spans[-1])
    return out


def measure(what: str, schedule: str, args, cache_dir=None) -> dict:
    """Run one measurement in a fresh process."""
    env = dict(os.environ, PDJAX_NO_COMPILATION_CACHE="1", PDJAX_COMPILE_PROGRESS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if args.threads:
        env["PDJAX_COMPILE_THREADS"] = str(args.threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--schedules", schedule,
           "--scale", str(args.scale)] + (["--cache-dir", cache_dir] if cache_dir else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{what} {schedule} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def table(rows, vag: float, disk: bool) -> str:
    cols = [("schedule", 17, "s"), ("step s", 8, ".1f"), ("ratio", 7, ".2f"), ("trace s", 9, ".1f"),
            ("XLA s", 8, ".1f"), ("compiles", 10, "d"), ("programs", 10, "d"), ("distinct", 10, "d"),
            ("compile() s", 13, ".1f"), ("1st/10th", 10, ".2f"), ("wall", 7, ".2f")]
    if disk:
        cols += [("cached s", 10, ".1f"), ("ratio", 7, ".2f")]
    head = "".join(f"{n:<{w}}" if f == "s" else f"{n:>{w}}" for n, w, f in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        vals = [r["schedule"], r["step"], r["step"] / vag, r["trace"], r["xla"], r["compiles"],
                r.get("compiled", 0) + r.get("relocated", 0), r.get("distinct", 0), r["compile"],
                r["span_ratio"], r["wall_ratio"]]
        if disk:
            vals += [r["cached"], r["cached"] / vag]
        lines.append("".join(f"{v:<{w}}" if f == "s" else f"{v:>{w}{f}}" for v, (_, w, f) in zip(vals, cols)))
    return "\n".join(lines)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--scale", type=int, default=1, help="multiplies the model widths, rows and tokens")
    ap.add_argument("--threads", type=int, default=0, help="compile threads (PDJAX_COMPILE_THREADS; 0: default)")
    ap.add_argument("--disk-cache", action="store_true", help="also the first step with a filled persistent cache")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per measuring process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.schedules, args.scale, args.cache_dir)))
        return
    t_start = time.perf_counter()
    schedules = [s for s in args.schedules.split(",") if s]
    print(f"{RANKS} ranks on {RANKS} CPU devices, {os.cpu_count()} cores; tiny(4 layers, 2 dense) x{args.scale}, "
          f"{MICROBATCHES} micro-batches of {ROWS * args.scale} x {T * args.scale} tokens; each cell a fresh process",
          flush=True)
    vags = [measure("vag", "-", args)["vag"]]
    rows = []
    for name in schedules:
        row = {"schedule": name, **measure("step", name, args), **measure("compiled", name, args)}
        if args.disk_cache:
            with tempfile.TemporaryDirectory() as d:
                measure("step", name, args, cache_dir=d)
                row["cached"] = measure("step", name, args, cache_dir=d)["step"]
        rows.append(row)
        print(f"  {name}: first step {row['step']:.1f} s", flush=True)
    vags.append(measure("vag", "-", args)["vag"])
    vag = sum(vags) / len(vags)
    print(f"\nunsplit value_and_grad first call: {vag:.2f} s (runs: {', '.join(f'{v:.2f}' for v in vags)})")
    print(table(rows, vag, args.disk_cache))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
