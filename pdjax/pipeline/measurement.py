"""Executed schedules against their simulation: one measured row per schedule.

:func:`measure_schedule` runs a schedule of the IR as real training steps of the pdjax
model (:class:`pdjax.pipeline.Executor`): it compiles every program first, warms up with
one step, times every op in isolation (:meth:`Executor.measure_ops`: one op at a time,
inputs ready before the clock starts, outputs ready when it stops), runs ``repeats``
measured steps and keeps the one with the median makespan, then simulates the schedule
with the isolated op times and the executor's byte model (``memory=ex.stage_memory``).
The result, an :class:`ExecutedRow`, puts the measured run, the simulation and the
closed-form bubble side by side; :func:`measure_executor` does the same for an executor
that already exists.

Formula bubble. :func:`pdjax.pipeline.bubble_formula` gives the idle time of one device
for identical stages. It is evaluated with the stage means of the measured op costs (ms)
and ``P`` = the stages of one pipeline (ranks, or ``2 x ranks`` for DualPipeV), and turned
into a ratio comparable with ``Timeline.bubble_ratio`` as the idle share of a rank that
does the simulation's mean per-rank busy time: ``bubble / (bubble + mean busy)``. When the
formula is exact and every rank idles equally this is the simulated bubble ratio.
``formula_applies`` / ``formula_note`` (from :func:`pdjax.pipeline.formula_conditions`
with the per-stage costs) say whether the formula is exact for the measured costs; real
stages differ (the first embeds, the last computes the loss), so it usually is not.

:func:`plot_pair` draws the measured and the simulated Gantt chart on one time axis;
:func:`text_table` prints rows (the executed-bubbles experiment's report has the markdown
table: :func:`pdjax.experiments.executed_bubbles.report_table`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from pdjax.schedules.formulas import bubble_formula, formula_conditions
from pdjax.schedules.generators import build
from pdjax.schedules.measured import op_costs_from_timeline
from pdjax.schedules.schedule import Schedule
from pdjax.schedules.simulate import simulate
from pdjax.arguments import check_int

COLUMNS = ("schedule", "P", "ranks", "microbatches", "batch", "seq_len", "measured_makespan_ms",
           "simulated_makespan_ms", "makespan_error", "measured_bubble_ratio", "simulated_bubble_ratio",
           "formula_bubble_ms", "formula_bubble_ratio", "formula_applies", "formula_note",
           "measured_peak_bytes", "simulated_peak_bytes", "dispatch_ms", "inrun_simulated_makespan_ms",
           "inrun_makespan_error", "contention", "mode", "comm_ms")


@dataclass(frozen=True, eq=False)
class ExecutedRow:
    """One executed schedule next to its simulation. Times in ms, memory in bytes per rank.

    ``makespan_error`` = simulated / measured - 1 (negative: the run took longer than the
    isolated op times add up to). ``inrun_*``: the same simulation fed with the op times as
    they ran in the measured step (per op kind and stage, medians), which tests the
    simulator's schedule model apart from op times; ``contention``: the measured step's busy
    time over the isolated ops' (how much slower ops ran with the other ranks running). ``step_makespans_ms``: every measured step's makespan;
    ``measured`` is the median one's timeline, ``simulated`` the simulation's.
    ``mode``: "threads" (one process, a host thread per rank: :class:`Executor`) or
    "cluster" (a process per rank on its own core, the multi-controller executor of a
    ``jax.distributed`` launch); ``comm_ms``: the cross-rank latency the simulation used (0:
    a value's time in flight shows as the consumer's wait before its op).
    ``costs``: the per-stage op costs the simulation used (``F, B, I, W, FB, FI``, lists).
    """

    schedule: str
    P: int
    ranks: int
    microbatches: int
    batch: int
    seq_len: int
    measured_makespan_ms: float
    simulated_makespan_ms: float
    makespan_error: float
    measured_bubble_ratio: float
    simulated_bubble_ratio: float
    formula_bubble_ms: float
    formula_bubble_ratio: float
    formula_applies: bool
    formula_note: str
    measured_peak_bytes: tuple
    simulated_peak_bytes: tuple
    dispatch_ms: float
    inrun_simulated_makespan_ms: float = math.nan
    inrun_makespan_error: float = math.nan
    contention: float = math.nan
    mode: str = "threads"
    comm_ms: float = 0.0
    step_makespans_ms: tuple = ()
    costs: dict = field(default_factory=dict, repr=False)
    op_costs: object = field(default=None, repr=False)
    measured: object = field(default=None, repr=False)
    simulated: object = field(default=None, repr=False)

    def as_dict(self) -> dict:
        """The table columns plus the step makespans and per-stage costs (JSON-ready)."""
        out = {k: getattr(self, k) for k in COLUMNS}
        out["measured_peak_bytes"] = list(self.measured_peak_bytes)
        out["simulated_peak_bytes"] = list(self.simulated_peak_bytes)
        out["step_makespans_ms"] = list(self.step_makespans_ms)
        out["costs"] = {k: list(v) for k, v in self.costs.items()}
        return out


def measure_schedule(name, cfg, *, num_ranks: int = 2, num_microbatches: int = 8,
                     batch_shape=(16, 32), params=None, tokens=None, devices=None, repeats: int = 3,
                     op_repeats: int = 3, seed: int = 0, layers_per_stage=None, cluster: bool = False,
                     cores=None) -> ExecutedRow:
    """Build, compile and measure schedule ``name`` of model ``cfg`` (see the module docstring).
    ``name`` may also be a :class:`~pdjax.pipeline.Schedule` (e.g. from ``search``); then
    ``num_ranks`` and ``num_microbatches`` are the schedule's.

    ``batch_shape``: ``(B, T)`` of the random token batch (``B`` sequences, split into
    ``num_microbatches``), ignored when ``tokens`` are given. ``params``: the model's params
    (default: ``pdjax.init_params(cfg, key(seed))``). ``devices``: default the first
    ``num_ranks`` devices, one per rank. ``repeats``: measured steps (the median makespan is
    kept; the lower middle one for an even count); ``op_repeats``: isolated runs of every op
    (medians). ``cluster``: one process per rank in a ``jax.distributed`` launch, each
    pinned to a core of its own (``cores``, taken in turn; default the available cores) and
    running the multi-controller executor (:mod:`pdjax.pipeline.measurement_worker`), instead
    of one thread per rank here."""
    import jax

    from pdjax.model.transformer import init_params
    from pdjax.pipeline.executor import Executor

    if isinstance(name, Schedule):
        schedule, num_ranks = name, name.num_ranks
    else:
        num_ranks = check_int("num_ranks", num_ranks)
        schedule = build(name, num_ranks, check_int("num_microbatches", num_microbatches))
    if params is None:
        params = init_params(cfg, jax.random.key(seed))
    if tokens is None:
        B, T = (check_int("batch_shape entry", v) for v in batch_shape)
        tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    if cluster:
        return measure_in_cluster(schedule, cfg, params, tokens, repeats=check_int("repeats", repeats),
                                  op_repeats=check_int("op_repeats", op_repeats), layers_per_stage=layers_per_stage,
                                  cores=cores)
    if devices is None:
        devices = jax.devices()[:num_ranks]
    ex = Executor(schedule, cfg, devices=devices, layers_per_stage=layers_per_stage, measure=True)
    return measure_executor(ex, params, tokens, repeats=repeats, op_repeats=op_repeats)


def measure_in_cluster(schedule, cfg, params, tokens, *, repeats: int, op_repeats: int, layers_per_stage=None,
                       cores=None, timeout_s: float = 900.0, stream=None):
    """The :class:`ExecutedRow` of ``schedule`` measured with one process per rank of a
    ``jax.distributed`` launch (:func:`pdjax.cluster.launch` with ``pin_cores``), each pinned
    to its core (``cores``; default the available cores in turn) and running the multi-controller
    executor (:mod:`pdjax.pipeline.measurement_worker`). Ops are timed in isolation under a
    lock of the machine; values between ranks cross with the transfer server, their time in
    flight shows as idle time before the consuming op (the simulation gets ``comm = 0``)."""
    import os
    import pickle
    import sys
    import tempfile

    import jax

    from pdjax.cluster import launch

    n = schedule.num_ranks
    with tempfile.TemporaryDirectory(prefix="pdjax-executed-") as tmp:
        spec, out = os.path.join(tmp, "spec.pkl"), os.path.join(tmp, "row.pkl")
        with open(spec, "wb") as f:
            pickle.dump(dict(schedule=schedule, cfg=cfg, params=jax.tree.map(np.asarray, params),
                             tokens=np.asarray(tokens), repeats=repeats, op_repeats=op_repeats,
                             layers_per_stage=layers_per_stage), f)
        launch([sys.executable, "-m", "pdjax.pipeline.measurement_worker", spec, out], n, 1, timeout_s=timeout_s,
               stream=stream, pin_cores=True if cores is None else list(cores))
        with open(out, "rb") as f:
            return pickle.load(f)


def measure_executor(ex, params, tokens, *, repeats: int = 3, op_repeats: int = 3) -> ExecutedRow:
    """:func:`measure_schedule` for an existing measuring :class:`Executor` ``ex``."""
    repeats = check_int("repeats", repeats)
    op_repeats = check_int("op_repeats", op_repeats)
    if not ex.measure:
        raise ValueError("the executor must measure (Executor(..., measure=True))")
    tokens = ex.check_batch(tokens)
    ex.compile(params, tokens.shape)
    ex.step(params, tokens)                                   # warm-up: first dispatches, allocations
    op_costs = ex.measure_ops(params, tokens, repeats=op_repeats)

    def step():
        ex.step(params, tokens)
        return ex.last_timeline, ex.last_memory, 0.0
    return _measured_row(ex.schedule, tokens.shape, step, repeats, op_costs, ex.stage_memory)


def _measured_row(schedule, shape, step, repeats: int, op_costs, stage_memory, *, comm_ms: float = 0.0,
                  mode: str = "threads") -> ExecutedRow:
    """Run ``repeats`` measured steps (``step() -> (timeline, peak bytes per rank, in-run link
    ms)``), keep the median-makespan one, and put it beside the simulation fed with the
    isolated ``op_costs`` (and ``comm_ms``) and beside the one fed with its own op times."""
    runs = []
    for _ in range(repeats):
        timeline, peak, link = step()
        runs.append((timeline, np.asarray(peak, dtype=float).copy(), link))
    order = sorted(range(repeats), key=lambda i: runs[i][0].makespan)
    measured, peak, inrun_comm = runs[order[(repeats - 1) // 2]]
    costs = op_costs.simulate_kwargs()
    simulated = simulate(schedule, **costs, comm=comm_ms, memory=stage_memory)
    inrun = simulate(schedule, **op_costs_from_timeline(measured).simulate_kwargs(), comm=inrun_comm)
    row = _row(schedule, shape, measured, peak, simulated, costs, op_costs, [r[0].makespan for r in runs])
    return dataclasses.replace(row, inrun_simulated_makespan_ms=float(inrun.makespan),
                               inrun_makespan_error=float(inrun.makespan / measured.makespan - 1),
                               contention=float(measured.busy.sum() / simulated.busy.sum()),
                               mode=mode, comm_ms=float(comm_ms))


def formula_bubble(name: str, num_stages: int, costs: dict, mean_busy: float) -> tuple[float, float, bool, str]:
    """``(bubble ms, bubble ratio, applies, note)`` of the closed form for per-stage
    ``costs`` (``F, B, W, FB`` arrays): the formula at the stage means, the ratio
    ``bubble / (bubble + mean_busy)``, and whether the formula is exact for these costs."""
    mean = {k: float(np.mean(costs[k])) for k in ("F", "B", "W", "FB")}
    dual = name in ("dualpipe", "dualpipev")
    try:
        applies, note = formula_conditions(name, F=costs["F"], B=costs["B"], W=costs["W"],
                                           FB=costs["FB"] if dual else None)
        bubble = float(bubble_formula(name, num_stages, F=mean["F"], B=mean["B"], W=mean["W"],
                                      FB=mean["FB"] if dual else None))
    except ValueError as err:
        return math.nan, math.nan, False, str(err)
    total = bubble + mean_busy
    return bubble, (bubble / total if total > 0 else math.nan), applies, note


def _row(schedule, shape, measured, peak, simulated, costs, op_costs, makespans) -> ExecutedRow:
    # the formulas' P: stages of one pipeline (DualPipeV: 2 x ranks), but ranks for interleaved
    # 1F1B, whose formula takes per-chunk costs
    P = schedule.num_ranks if schedule.name == "interleaved-1f1b" else len(schedule.layout.pipelines[0].stages)
    f_b, f_ratio, applies, note = formula_bubble(schedule.name, P, costs, float(np.mean(simulated.busy)))
    return ExecutedRow(
        schedule=schedule.name, P=P, ranks=schedule.num_ranks, microbatches=schedule.num_microbatches,
        batch=int(shape[0]), seq_len=int(shape[1]),
        measured_makespan_ms=float(measured.makespan), simulated_makespan_ms=float(simulated.makespan),
        makespan_error=float(simulated.makespan / measured.makespan - 1) if measured.makespan > 0 else math.nan,
        measured_bubble_ratio=measured.bubble_ratio, simulated_bubble_ratio=simulated.bubble_ratio,
        formula_bubble_ms=f_b, formula_bubble_ratio=f_ratio, formula_applies=bool(applies), formula_note=note,
        measured_peak_bytes=tuple(round(float(x)) for x in peak),
        simulated_peak_bytes=tuple(round(float(x)) for x in simulated.peak_memory),
        dispatch_ms=float(op_costs.dispatch_ms), step_makespans_ms=tuple(float(m) for m in makespans),
        costs={k: [float(x) for x in v] for k, v in costs.items()}, op_costs=op_costs,
        measured=measured, simulated=simulated)


def plot_pair(row: ExecutedRow, path=None, dpi: int = 120):
    """The measured (top) and simulated (bottom) Gantt charts of ``row`` on one time axis
    (ms); saved to ``path`` (.png, .svg or .pdf) when given. Returns the matplotlib
    ``Figure`` (built without pyplot, so no global figure state is touched; a
    :class:`pdjax.schedules.Figure`, so a notebook shows it)."""
    from pdjax.schedules.figure import Figure
    from pdjax.schedules.gantt import draw

    ranks = row.ranks
    fig = Figure(figsize=(12.0, 2 * (0.45 * ranks + 1.6)))
    top, bottom = fig.subplots(2, 1)
    titles = ((f"{row.schedule} measured: makespan {row.measured_makespan_ms:.1f} ms, "
               f"bubble ratio {row.measured_bubble_ratio:.3f}"),
              (f"simulated with isolated op times: makespan {row.simulated_makespan_ms:.1f} ms "
               f"({100 * row.makespan_error:+.1f}%), bubble ratio {row.simulated_bubble_ratio:.3f}"))
    for ax, timeline, title in zip((top, bottom), (row.measured, row.simulated), titles):
        draw(timeline, ax=ax, title=title)
        ax.set_xlabel("ms")
    right = max(row.measured_makespan_ms, row.simulated_makespan_ms) or 1.0
    for ax in (top, bottom):
        ax.set_xlim(0, right)
    fig.tight_layout()
    if path is not None:
        suffix = str(path).lower().rsplit(".", 1)[-1]
        if suffix not in ("png", "svg", "pdf"):
            raise ValueError(f"plot path must end in .png, .svg or .pdf, got {str(path)!r}")
        fig.savefig(path, dpi=dpi)
    return fig


def table_cells(row: ExecutedRow) -> list[str]:
    """One row's cells under :data:`TABLE_HEAD` (the text table's and the report's). The
    measured makespan is the median step's, with the spread over the measured steps."""
    formula = "n/a" if math.isnan(row.formula_bubble_ratio) else f"{row.formula_bubble_ratio:.3f}"
    if not math.isnan(row.formula_bubble_ratio) and not row.formula_applies:
        formula += "*"
    same = "yes" if row.measured_peak_bytes == row.simulated_peak_bytes else "NO"
    steps = row.step_makespans_ms or (row.measured_makespan_ms,)
    return [row.schedule, str(row.P), str(row.ranks), str(row.microbatches),
            f"{row.measured_makespan_ms:.1f} [{min(steps):.1f}-{max(steps):.1f}]", f"{row.simulated_makespan_ms:.1f}",
            f"{100 * row.makespan_error:+.1f}%", f"{row.measured_bubble_ratio:.3f}",
            f"{row.simulated_bubble_ratio:.3f}", formula, f"{100 * row.inrun_makespan_error:+.1f}%",
            f"{row.contention:.2f}",
            "/".join(f"{b / 2**20:.2f}" for b in row.measured_peak_bytes), same, f"{row.dispatch_ms:.3f}"]


#: The executed-schedule table's columns: the measured makespan is the median step's with
#: [min-max] over the measured steps.
TABLE_HEAD = ["schedule", "P", "ranks", "m", "measured ms [min-max]", "simulated ms", "error", "bubble meas.",
              "bubble sim.", "bubble formula", "error (in-run op times)", "contention", "peak MiB per rank",
              "peak = sim", "dispatch ms"]


def text_table(rows) -> str:
    """A fixed-width text table of :class:`ExecutedRow` s."""
    table = [TABLE_HEAD] + [table_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(TABLE_HEAD))]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
           for line in table]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out) + "\n"
