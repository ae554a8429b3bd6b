"""Benchmark: build, validate and simulate pipeline schedules; cost vs number of ops.

Prints a table and a fit (no assertions). The target: DualPipe with 64 ranks
and 1,024 micro-batches built, validated and simulated in under 2 s; cost linear in ops.

For each size the best (minimum) of ``--repeats`` runs is kept: the dev machine has 2
cores shared with other processes, so the minimum is the least noisy estimate. The
garbage collector stays on as in normal use; the ``gc s`` column is the time it took
inside the kept run (CPython's full collections start only once a run keeps enough
objects alive, so they show up from a few tens of thousands of ops on).

    .venv/bin/python benchmarks/pipeline_schedules.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

import pdjax.pipeline as pp

TARGET = ("dualpipe", 64, 1024, 2.0)  # schedule, ranks, micro-batches, seconds

# (ranks, micro-batches): 8..64 ranks, 16..1024 micro-batches (DualPipe needs mbs >= 2 x ranks)
SIZES = [(8, 16), (8, 64), (16, 128), (8, 512), (32, 256), (16, 512), (8, 2048), (64, 256),
         (32, 512), (64, 512), (32, 1024), (64, 768), (64, 1024)]
QUICK_SIZES = [(8, 16), (8, 64), (16, 128), (32, 256), (64, 256)]


class _GcTimer:
    """Seconds spent in garbage collection while active (via ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(name: str, ranks: int, microbatches: int, repeats: int = 3) -> dict:
    """Best-of-``repeats`` (by total) seconds for build, validate and simulate."""
    best = None
    for _ in range(repeats):
        gc.collect()  # start each repeat from the same heap
        with _GcTimer() as gct:
            s, t_build = _timed(lambda: pp.build(name, ranks, microbatches))
            _, t_val = _timed(s.validate)
            t, t_sim = _timed(lambda s=s: pp.simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5, check=False))
        row = {"schedule": name, "ranks": ranks, "microbatches": microbatches, "ops": s.num_ops,
               "build": t_build, "validate": t_val, "simulate": t_sim, "gc": gct.seconds,
               "total": t_build + t_val + t_sim, "bubble_ratio": t.bubble_ratio}
        del s, t
        if best is None or row["total"] < best["total"]:
            best = row
    best["us_per_op"] = 1e6 * best["total"] / best["ops"]
    return best


def linear_fit(ops, seconds) -> dict:
    """Least squares ``seconds = a + b * ops``; R^2; log-log slope (1.0 = linear)."""
    x, y = np.asarray(ops, dtype=float), np.asarray(seconds, dtype=float)
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    exponent = float(np.polyfit(np.log(x), np.log(y), 1)[0])
    us = 1e6 * y / x
    med = float(np.median(us))
    dev = us - med
    k = int(np.argmax(np.abs(dev)))
    return {"a": float(a), "b": float(b), "r2": r2, "exponent": exponent, "median_us": med,
            "max_dev_us": float(dev[k]), "max_dev_rel": float(dev[k] / med), "max_dev_ops": int(x[k])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size; the minimum is kept (default 3)")
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    measure("dualpipe", 8, 16, repeats=1)  # warm up imports and caches

    head = (f"{'schedule':<10}{'ranks':>6}{'mbs':>6}{'ops':>8}{'build s':>9}{'valid s':>9}{'sim s':>8}"
            f"{'total s':>9}{'gc s':>7}{'us/op':>7}{'bubble':>8}")
    print(f"DualPipe, best of {args.repeats} runs per size")
    print(head)
    print("-" * len(head))
    rows = []
    for ranks, mbs in sorted(sizes, key=lambda rm: pp.build("dualpipe", *rm).num_ops):
        r = measure("dualpipe", ranks, mbs, repeats=args.repeats)
        rows.append(r)
        print(f"{r['schedule']:<10}{r['ranks']:>6}{r['microbatches']:>6}{r['ops']:>8}{r['build']:>9.3f}"
              f"{r['validate']:>9.3f}{r['simulate']:>8.3f}{r['total']:>9.3f}{r['gc']:>7.3f}"
              f"{r['us_per_op']:>7.2f}{r['bubble_ratio']:>8.4f}")

    fit = linear_fit([r["ops"] for r in rows], [r["total"] for r in rows])
    print(f"\nfit: time = {fit['a'] * 1e3:.2f} ms + {fit['b'] * 1e6:.2f} us x ops   "
          f"R^2 = {fit['r2']:.4f}   log-log slope = {fit['exponent']:.3f} (1.000 = linear)")
    print(f"us/op: median {fit['median_us']:.2f}, max deviation {fit['max_dev_us']:+.2f} us "
          f"({100 * fit['max_dev_rel']:+.0f}%) at {fit['max_dev_ops']} ops")
    nogc = linear_fit([r["ops"] for r in rows], [r["total"] - r["gc"] for r in rows])
    print(f"without gc time: R^2 = {nogc['r2']:.4f}, log-log slope = {nogc['exponent']:.3f}, us/op median "
          f"{nogc['median_us']:.2f}, max deviation {nogc['max_dev_us']:+.2f} us ({100 * nogc['max_dev_rel']:+.0f}%) "
          f"at {nogc['max_dev_ops']} ops")

    name, ranks, mbs, limit = TARGET
    target = next((r for r in rows if (r["schedule"], r["ranks"], r["microbatches"]) == (name, ranks, mbs)), None)
    if target is None:
        target = measure(name, ranks, mbs, repeats=args.repeats)
    verdict = "PASS" if target["total"] < limit else "FAIL"
    print(f"target: {name} {ranks} ranks x {mbs} micro-batches ({target['ops']} ops) in "
          f"{target['total']:.3f} s < {limit:g} s: {verdict}")

    print()
    print(f"{'schedule':<18}{'ranks':>6}{'mbs':>6}{'ops':>9}{'total s':>9}{'us/op':>7}")
    for other in ("1f1b", "zb1p", "interleaved-1f1b", "dualpipev"):
        r = measure(other, 32, 256, repeats=args.repeats)
        print(f"{other:<18}{r['ranks']:>6}{r['microbatches']:>6}{r['ops']:>9}{r['total']:>9.3f}{r['us_per_op']:>7.2f}")


if __name__ == "__main__":
    main()
