"""Benchmark: executed pipeline schedules vs simulate() fed with isolated per-op times.

Each schedule runs as real training steps of the pdjax model (the pipeline executor).

For every rank count and schedule (:func:`pdjax.pipeline.measurement.measure_schedule`):

(a) per-op durations measured in isolation (one op at a time, inputs ready before the clock
    starts, outputs ready when it stops; medians, ms): F, B, I, W and the overlapped F&B
    pairs, per stage;
(b) the measured makespan of the real overlapped run (median of the measured steps) against
    ``simulate()`` fed with those durations: error = simulated / measured - 1, per schedule,
    and the median |error| per rank count;
(c) the dispatch overhead per op (the time a compiled call takes to return; per-op blocking
    costs one host round trip of this order).

Rank counts: as many ranks as physical cores, then more (4 and 8 simulated devices on the
8 host devices set below). The model has 2 layers per rank (so DualPipeV's 2 x ranks stages
hold one layer each) and the same width at every rank count. Prints tables, asserts nothing.
Compiled programs go to the persistent compilation cache ``.jax_cache/`` (as in the tests):
the first run compiles every stage program of every schedule and rank count (minutes on 2
cores), later runs mostly measure.

    .venv/bin/python benchmarks/pipeline_executor.py [--quick] [--ranks 2,4,8]
        [--schedules 1f1b,zb1p,dualpipe,dualpipev] [--scale 1]

In one process XLA:CPU runs one op on every core (the benchmark prints how much faster two
devices run at once than one alone: about 1.0x on this backend;
``--xla_cpu_multi_thread_eigen=false`` does not change that on jax 0.10), so isolated op
times are faster than the same ops with the other ranks running. ``--cluster`` runs each
rank in a process of a ``jax.distributed`` launch pinned to one core (``pdjax launch
--pin-cores``), the multi-controller executor: a rank per core, as a rank per GPU (values
between the CPU ranks through shared memory). Measured on the 2-core machine, quiet,
``--ranks 2 --cluster --scale 3 --repeats 5``: median |error| 5.1 % (1F1B -4.5 %, ZB1P
-5.0 %, DualPipe -8.6 %, DualPipeV -5.3 %), contention 1.03 (docs/pipeline.md).
(b) also reports the simulation fed with the op times as they ran.
"""

from __future__ import annotations

import argparse
import os
import time

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

# compiling dominates a cold run (every stage's programs, per rank count and schedule): keep
# the compiled programs in the repository's persistent cache, as the tests do
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pdjax  # noqa: E402
from pdjax.pipeline.measurement import measure_schedule, text_table  # noqa: E402

SCHEDULES = ("1f1b", "zb1p", "dualpipe", "dualpipev")


def physical_cores() -> int:
    """Cores this process may run on (affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def model_for(ranks: int, scale: int):
    """The tiny preset, widths x ``scale``, 2 layers per rank (the first dense)."""
    base = pdjax.configs.tiny()
    fields = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
              "num_attention_heads")
    return base.replace(num_hidden_layers=2 * ranks, **{f: getattr(base, f) * scale for f in fields})


def op_table(rows) -> str:
    """(a): per schedule and stage, the isolated medians (ms) of F, B, I, W and the mean of the
    stage's overlapped pairs (F&B with a full backward, F&I with an input backward)."""
    head = f"{'schedule':<10}{'ranks':>6}{'stage':>6}" + "".join(f"{k:>9}" for k in ("F", "B", "I", "W", "F&B", "F&I"))
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r.op_costs.durations
        for s in range(r.op_costs.num_stages):
            cells = [d.get((k, s)) for k in ("F", "B", "I", "W")]
            for kind in ("B", "I"):
                pairs = [v for k, v in d.items() if k[0] == "FB" and k[1] == s and k[3] == kind]
                cells.append(float(np.mean(pairs)) if pairs else None)
            lines.append(f"{r.schedule:<10}{r.ranks:>6}{s:>6}"
                         + "".join(f"{c:9.3f}" if c is not None else f"{'-':>9}" for c in cells))
    return "\n".join(lines)


def error_table(by_ranks: dict, cores: int) -> str:
    """(b) summary per rank count: the median |makespan error| with isolated op times, with the
    op times as they ran (the schedule model alone), and the measured contention factor."""
    head = (f"{'ranks':>6}{'ranks/cores':>13}{'median |error|':>16}{'in-run op times':>17}"
            f"{'contention':>12}   errors per schedule (isolated / in-run)")
    lines = [head, "-" * len(head)]
    for ranks, rows in by_ranks.items():
        errs = ", ".join(f"{r.schedule} {100 * r.makespan_error:+.1f}% / {100 * r.inrun_makespan_error:+.1f}%"
                         for r in rows)
        med = float(np.median([abs(r.makespan_error) for r in rows]))
        med_in = float(np.median([abs(r.inrun_makespan_error) for r in rows]))
        cont = float(np.median([r.contention for r in rows]))
        lines.append(f"{ranks:>6}{ranks / cores:>13.1f}{100 * med:>15.1f}%{100 * med_in:>16.1f}%{cont:>12.2f}   {errs}")
    return "\n".join(lines)


def core_sharing(devices) -> float:
    """Speed-up of one matmul chain run on two devices at once over one device alone (2.0:
    each device has its own core; 1.0: one op already uses every core, as on XLA:CPU)."""
    import threading

    import jax.numpy as jnp

    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    xs = [jax.device_put(jnp.ones((512, 512)), d) for d in devices[:2]]
    for x in xs:
        f(x).block_until_ready()

    def work(x, n=40):
        for _ in range(n):
            f(x).block_until_ready()
    t0 = time.perf_counter()
    work(xs[0])
    alone = time.perf_counter() - t0
    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * alone / (time.perf_counter() - t0)


def dispatch_table(rows) -> str:
    """(c): the dispatch overhead per op against the mean isolated op time."""
    head = f"{'schedule':<10}{'ranks':>6}{'dispatch ms/op':>16}{'mean op ms':>12}{'share':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mean_op = float(np.mean(list(r.op_costs.durations.values())))
        lines.append(f"{r.schedule:<10}{r.ranks:>6}{r.dispatch_ms:>16.3f}{mean_op:>12.3f}"
                     f"{100 * r.dispatch_ms / mean_op:>7.1f}%")
    return "\n".join(lines)


def run_ranks(ranks: int, schedules, args) -> list:
    cfg = model_for(ranks, args.scale)
    params = pdjax.init_params(cfg, jax.random.key(0))
    m = args.microbatches or 2 * ranks
    rows = []
    for name in schedules:
        t0 = time.perf_counter()
        row = measure_schedule(name, cfg, num_ranks=ranks, num_microbatches=m,
                               batch_shape=(m * args.rows * args.scale, args.seq_len * args.scale),
                               params=params, repeats=args.repeats, op_repeats=args.op_repeats,
                               cluster=args.cluster)
        print(f"  {name} at {ranks} ranks: {time.perf_counter() - t0:.1f} s (compile, warm-up, "
              f"{args.op_repeats} isolated + {args.repeats} measured steps)", flush=True)
        rows.append(row)
    return rows


def parse_args():
    cores = physical_cores()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default=None,
                    help=f"comma-separated rank counts (default: {min(cores, 8)},4,8: cores, then more)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--microbatches", type=int, default=0, help="default: 2 x ranks")
    ap.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (x scale)")
    ap.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (x scale)")
    ap.add_argument("--scale", type=int, default=1, help="multiplies model widths, rows and seq-len")
    ap.add_argument("--repeats", type=int, default=3, help="measured steps (median makespan kept)")
    ap.add_argument("--op-repeats", type=int, default=3, help="isolated runs per op (medians)")
    ap.add_argument("--cluster", action="store_true",
                    help="one process per rank in a jax.distributed launch (pdjax.cluster.launch), each pinned "
                         "to its own core, running the multi-controller executor")
    ap.add_argument("--quick", action="store_true",
                    help="smallest settings: cores ranks only, 1f1b and dualpipe, 1 repeat each")
    args = ap.parse_args()
    if args.quick:
        args.ranks = args.ranks or str(min(cores, 8))
        args.schedules, args.repeats, args.op_repeats = "1f1b,dualpipe", 1, 1
    args.ranks = sorted({int(x) for x in (args.ranks or f"{min(cores, 8)},4,8").split(",")})
    return args, cores


def main() -> None:
    t_start = time.perf_counter()
    args, cores = parse_args()
    schedules = [s for s in args.schedules.split(",") if s]
    print(f"{jax.device_count()} {jax.default_backend()} devices on {cores} cores; ranks {args.ranks}; "
          f"tiny preset x{args.scale}, {args.rows * args.scale} x {args.seq_len * args.scale} tokens per "
          f"micro-batch; " + ("one process per rank, pinned to a core each" if args.cluster else "one process, a thread per rank"))
    by_ranks = {}
    for ranks in args.ranks:
        by_ranks[ranks] = run_ranks(ranks, schedules, args)
    rows = [r for rs in by_ranks.values() for r in rs]
    print("\n(a) per-op durations measured in isolation (median ms)")
    print(op_table(rows))
    print("\n(b) measured makespan of the overlapped run vs simulate() fed with (a)")
    print(text_table(rows))
    print(error_table(by_ranks, cores))
    if args.cluster:
        print(f"Each rank is a process pinned to core (rank mod {cores}) with one CPU device: with ranks <= cores "
              "no two ranks share a core, so an op's isolated time is its time in the run (contention ~1) and "
              "the simulation predicts the makespan; with more ranks than cores two ranks share a core "
              "(contention ~ ranks / cores) and |error| grows. The in-run column feeds the simulator the op "
              "times as they ran: what is left is the schedule model's own error.")
    else:
        print(f"The simulated devices share {cores} cores, and XLA:CPU runs one op on all of them: two devices "
              f"running at once go {core_sharing(jax.devices()):.2f}x as fast as one alone (2.0 would be a core "
              "each). So an op measured alone gets every core and ops of concurrent ranks slow each other "
              "(contention); a GPU per rank would not (nor --cluster: a rank per core). The in-run column "
              "feeds the simulator the op times as they ran: what is left is the schedule model's own error. "
              "With more ranks than cores |error| grows.")
    print("\n(c) dispatch overhead per op (time a compiled call takes to return)")
    print(dispatch_table(rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s (with a cold .jax_cache, mostly compiling)")


if __name__ == "__main__":
    main()
