"""The serving simulator against the engines it models (issue #12).

A Poisson trace (prompt lengths mixed over five padding buckets, 24..320 tokens; outputs
uniform 8..48 tokens) is served by ColocatedEngine and by PDEngine (configs.tiny(), 4 + 4
simulated CPU devices, 8 decode slots, whole-prompt prefill) and replayed through pdjax.sim
with each engine's own costs, measured when it runs (pdjax.experiments.sim_vs_engine):
prefill by engine.calibrate_prefill ("isolated") and as served beside decode steps, the
decode loop's iteration t(B, K, joined, left) fitted on the engine's own closed batches,
its spread, and (PD) how much slower decode steps run beside a prefill on the shared cores.

Prints measured vs predicted TTFT and ITL at P50 / P90 with the relative error (predicted /
measured - 1) for three predictions: "sim" (everything measured), "no jitter" (the same with
deterministic steps), "isolated" (calibrate_prefill and the decode fit only), per repeat and
the median over repeats; and per run the fits and two diagnostics: the served decode
iterations over the fitted step with and without a prefill in flight (without: the drift of
the step cost between calibration and serving, i.e. the noise floor on a shared machine).
See docs/sim.md#held-against-the-engines for a reference run and the error analysis.

Every cost is measured at run time: on 2 shared cores, check `top` first and expect noise.

Run: .venv/bin/python benchmarks/sim_vs_engine.py [--requests 300] [--rate 12] [--seed 0]
     [--repeats 3] [--engines colocated,pd] [--chunk 0] [--quick]
(defaults: ~4 min; --quick: 40 requests, one repeat, ~30 s once compiled)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pdjax  # noqa: E402
from pdjax.experiments import sim_vs_engine as sve  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def load() -> str:
    try:
        return "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load average n/a"


COLUMNS = (("model", "sim"), ("no_jitter", "no jitter"), ("isolated", "isolated"))


def print_rows(rows, title):
    print(f"\n{title}")
    print(f"{'engine':<10} {'metric':<5} {'pct':<4} {'measured ms':>11} "
          + " ".join(f"{head + ' ms':>12} {'error':>7}" for _, head in COLUMNS))
    for r in rows:
        print(f"{r['engine']:<10} {r['metric']:<5} {r['pct']:<4} {1e3 * r['measured_s']:>11.2f} "
              + " ".join(f"{1e3 * r[f'{k}_s']:>12.2f} {100 * r[f'{k}_err']:>+6.1f}%" for k, _ in COLUMNS))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="independent runs (fresh engine, same trace)")
    ap.add_argument("--engines", default="colocated,pd")
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk tokens (0: whole prompts)")
    ap.add_argument("--quick", action="store_true", help="40 requests, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = min(args.requests, 40), 1
    cfg = pdjax.configs.tiny()
    params = pdjax.init_params(cfg, jax.random.key(0))
    setup = sve.EngineSetup(chunk_tokens=args.chunk or None)
    trace = sve.make_trace(args.requests, args.rate, args.seed)
    span = trace[-1].arrival
    print(f"trace: {len(trace)} requests over {span:.1f} s ({len(trace) / max(span, 1e-9):.1f} req/s offered), "
          f"prompts {sorted({r.input_len for r in trace})}, outputs {min(r.output_len for r in trace)}.."
          f"{max(r.output_len for r in trace)}; {setup}")
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    runs = {k: [] for k in kinds}
    for rep in range(args.repeats):
        for kind in kinds:
            t0 = time.perf_counter()
            before = load()
            c = sve.compare_engine(kind, params, cfg, trace, setup=setup, seed=args.seed)
            runs[kind].append(c)
            s = c.sims["model"].summary
            util = {k: round(v, 2) for k, v in s.items() if k.startswith("util_")}
            print(f"\n[{kind} run {rep + 1}] {time.perf_counter() - t0:.0f} s; {before} -> {load()}")
            print(f"  prefill, isolated (engine.calibrate_prefill): {c.costs['isolated'].prefill}")
            print(f"  prefill, as served while decoding:          {c.served.fit}")
            print(f"  served / isolated prefill x{c.served.prefill_factor:.2f}; decode iterations beside a "
                  f"prefill x{c.served.decode_factor:.2f}" + ("" if kind == "pd" else " (not used: the pool lock)"))
            j = np.percentile(c.decode.jitter, [10, 50, 90])
            print(f"  decode loop: {c.decode.fit}")
            print(f"  decode step spread (measured / fitted, plain iterations): P10 {j[0]:.2f} "
                  f"P50 {j[1]:.2f} P90 {j[2]:.2f}")
            dc = sve.decode_contention(c.stats, c.decode.fit)
            print(f"  served decode iterations / fitted (median): {dc['prefill']:.2f} with a prefill in flight "
                  f"({dc['n_prefill']}), {dc['no_prefill']:.2f} without ({dc['n_no_prefill']}; != 1: the step "
                  f"cost drifted between calibration and serving)")
            print(f"  simulated utilisation {util}, measured span {c.stats['elapsed_s']:.2f} s "
                  f"vs simulated {s['span_s']:.2f} s")
            print_rows(c.rows, f"{kind}, run {rep + 1}")
    if args.repeats > 1:
        med = []
        for kind in kinds:
            for i, row in enumerate(runs[kind][0].rows):
                vals = [r.rows[i] for r in runs[kind]]
                med.append({**row, **{k: float(np.median([v[k] for v in vals]))
                                      for k in row if k.endswith(("_s", "_err"))}})
        print_rows(med, f"median over {args.repeats} runs")


if __name__ == "__main__":
    main()
