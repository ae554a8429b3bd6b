"""Benchmark: build, validate and simulate pipeline schedules; cost vs number of ops.

Prints a table (no assertions). The target from issue 3: DualPipe with 64 ranks and
1,024 micro-batches built, validated and simulated in under 2 s; cost linear in ops.

    .venv/bin/python benchmarks/pipeline_schedules.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import pdjax.pipeline as pp


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(name: str, ranks: int, microbatches: int, repeats: int = 1) -> dict:
    """Best-of-``repeats`` seconds for build, validate and simulate (validation not repeated)."""
    best = None
    for _ in range(repeats):
        s, t_build = _timed(lambda: pp.build(name, ranks, microbatches))
        _, t_val = _timed(s.validate)
        t, t_sim = _timed(lambda: pp.simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5, check=False))
        row = {"schedule": name, "ranks": ranks, "microbatches": microbatches, "ops": s.num_ops,
               "build": t_build, "validate": t_val, "simulate": t_sim,
               "total": t_build + t_val + t_sim, "bubble_ratio": t.bubble_ratio}
        if best is None or row["total"] < best["total"]:
            best = row
    best["us_per_op"] = 1e6 * best["total"] / best["ops"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = ap.parse_args()
    head = f"{'schedule':<10}{'ranks':>6}{'mbs':>6}{'ops':>9}{'build s':>9}{'valid s':>9}{'sim s':>8}{'total s':>9}{'us/op':>7}{'bubble':>8}"
    print(head)
    print("-" * len(head))
    sizes = [(8, 64), (16, 128), (32, 256), (64, 512), (64, 1024)]
    if args.quick:
        sizes = sizes[:3]
    rows = []
    for ranks, mbs in sizes:
        r = measure("dualpipe", ranks, mbs, repeats=1 if args.quick else 2)
        rows.append(r)
        print(f"{r['schedule']:<10}{r['ranks']:>6}{r['microbatches']:>6}{r['ops']:>9}{r['build']:>9.3f}"
              f"{r['validate']:>9.3f}{r['simulate']:>8.3f}{r['total']:>9.3f}{r['us_per_op']:>7.2f}{r['bubble_ratio']:>8.4f}")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        slope = (b["total"] / a["total"]) / (b["ops"] / a["ops"])
        print(f"\ngrowth: ops x{b['ops'] / a['ops']:.0f} -> time x{b['total'] / a['total']:.1f} "
              f"(ratio {slope:.2f}; 1.0 = linear)")
    print()
    print(f"{'schedule':<18}{'ranks':>6}{'mbs':>6}{'ops':>9}{'total s':>9}{'us/op':>7}")
    for name in ("1f1b", "zb1p", "interleaved-1f1b", "dualpipev"):
        r = measure(name, 32, 256)
        print(f"{name:<18}{r['ranks']:>6}{r['microbatches']:>6}{r['ops']:>9}{r['total']:>9.3f}{r['us_per_op']:>7.2f}")


if __name__ == "__main__":
    main()
