"""Experiment: pipeline schedules executed as real training steps, against their simulation.

For every schedule of the config, :func:`pdjax.pipeline.measurement.measure_schedule` runs the
model's training step with the :class:`pdjax.pipeline.Executor` (a measured timeline per
rank), times every op in isolation and simulates the schedule with those times and the
executor's byte model. ``[run] cluster = true`` (the default) runs each rank in a process of
a ``jax.distributed`` launch (:func:`pdjax.cluster.launch`), pinned to one CPU core
(``pin_cores``), with the multi-controller executor (the way ranks on several hosts run), so
ranks do not share cores while there are at least as many cores as ranks (more ranks take
the cores in turn and share them; the report says which); ``false`` runs every rank as a
thread of this process (on accelerators, where a rank is a device). The run directory gets ``<schedule>.png`` / ``.svg`` (measured over
simulated Gantt chart, one time axis), ``executed_bubbles.csv`` (one row per schedule),
``executed_bubbles.json`` (the rows with every step's makespan and the per-op costs) and
``report.md``. Times are measured (``wall_clock``); the shapes and the measured and
simulated peak bytes are reproducible (``metrics``).

``scale`` (a positive int) multiplies the model width (hidden size, FFN and expert FFN
sizes, LoRA ranks, attention heads), the sequence length and the rows per micro-batch, so
the same config runs larger on real accelerators unchanged: ``scale = 1`` is sized for a
2-core CPU, ``scale = 8`` gives ``small``-preset widths with 256-token sequences.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pdjax.configs import PRESETS
from pdjax.experiments import progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table
from pdjax.schedules.generators import GENERATORS, build

WIDTH_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank",
                "kv_lora_rank", "num_attention_heads")
#: The reproducible columns of a row (the rest are measured times).
REPRODUCIBLE = ("schedule", "P", "ranks", "microbatches", "batch", "seq_len", "formula_applies",
                "measured_peak_bytes", "simulated_peak_bytes")
MEASURED_NOTE = ("Measured: the median-makespan step of the executor's instrumented run; simulated: "
                 "`pdjax.schedules.simulate` fed with every op's median time measured in isolation.")


@dataclasses.dataclass(frozen=True)
class Run:
    schedules: list[str] = knob(["1f1b", "zb1p", "dualpipe", "dualpipev"], choices=GENERATORS, nonempty=True)
    ranks: int = knob(2, minimum=1)          # one device per rank
    microbatches: int = knob(8, minimum=1)
    repeats: int = knob(3, minimum=1)        # measured steps; the median makespan is reported
    op_repeats: int = knob(3, minimum=1)     # isolated runs of every op (medians)
    cluster: bool = True                     # a process per rank (jax.distributed), pinned to a core; false: threads

    def __post_init__(self):
        for name in self.schedules:         # the generators' own size checks, before anything runs
            try:
                build(name, self.ranks, self.microbatches)
            except ValueError as e:
                raise ValueError(f"schedules: {name} at ranks = {self.ranks}, microbatches = "
                                 f"{self.microbatches}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Model:
    preset: str = knob("tiny", choices=PRESETS)   # widths multiplied by scale
    layers: int = knob(4, minimum=1)              # decoder layers, split over a pipeline's stages
    dense_layers: int = knob(1, minimum=0)        # the first dense_layers are dense, the rest MoE
    seed: int = knob(0, minimum=0)


@dataclasses.dataclass(frozen=True)
class Batch:
    rows: int = knob(4, minimum=1)                # x scale sequences per micro-batch
    seq_len: int = knob(32, minimum=2)            # x scale tokens (the next-token loss needs 2)
    seed: int = knob(1, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    run: Run = table(Run)
    model: Model = table(Model)
    batch: Batch = table(Batch)

    def devices_needed(self) -> int:
        return 0 if self.run.cluster else self.run.ranks


def model_config(model: Model, scale: int):
    """The preset with ``layers`` decoder layers (the first ``dense_layers`` dense) and its
    widths multiplied by ``scale``."""
    import pdjax

    base = pdjax.configs.preset(model.preset)
    widths = {f: getattr(base, f) * scale for f in WIDTH_FIELDS if getattr(base, f) is not None}
    return base.replace(num_hidden_layers=model.layers, first_k_dense_replace=model.dense_layers, **widths)


def headline(rows) -> str:
    import numpy as np

    errors = [abs(r.makespan_error) for r in rows]
    parts = ", ".join(f"{r.schedule} {100 * r.measured_bubble_ratio:.1f}% (sim {100 * r.simulated_bubble_ratio:.1f}%)"
                      for r in rows)
    same = all(r.measured_peak_bytes == r.simulated_peak_bytes for r in rows)
    return (f"measured bubble ratio at {rows[0].ranks} ranks x {rows[0].microbatches} micro-batches: {parts}; "
            f"median |makespan error| of the simulation fed with isolated op times {100 * float(np.median(errors)):.1f}%; "
            f"measured peak memory {'equals' if same else 'DIFFERS from'} the simulated byte model")


def report_table(rows) -> str:
    """The rows (:class:`pdjax.pipeline.measurement.ExecutedRow`) as a markdown table, with a
    note on its columns."""
    from pdjax.pipeline.measurement import TABLE_HEAD, table_cells

    table_rows = [dict(zip(TABLE_HEAD, table_cells(r))) for r in rows]
    inexact: dict[str, list[str]] = {}
    for r in rows:
        if not r.formula_applies:
            inexact.setdefault(r.formula_note, []).append(r.schedule)
    why = "; ".join(f"{', '.join(names)}: {note}" for note, names in inexact.items()) or "none"
    note = ("measured ms: the median measured step's makespan, [min-max] over the measured steps; "
            "error = simulated / measured - 1, the simulation fed with op times measured in isolation; "
            "error (in-run op times): fed with the op times as they ran in the measured step; contention: "
            "the step's busy time over the isolated ops' (XLA:CPU runs one op on every core, so ranks "
            "sharing the cores slow each other). Bubble formula: the closed form at the stage means of the "
            "measured op costs, as bubble / (bubble + mean busy time per rank); * = not exact for these "
            f"costs ({why}). Peak: the executor's measured bytes per rank; \"peak = sim\": equal to "
            "simulate(memory=ex.stage_memory).")
    return markdown_table(table_rows) + "\n\n" + note + "\n"


def host_cores() -> int:
    """How many CPU cores this process may run on (the rank processes are pinned among them:
    :func:`pdjax.cluster.launch.available_cores`)."""
    from pdjax.cluster.launch import available_cores

    return len(available_cores())


def placement(r: Run, cores: int) -> str:
    """Where the ranks of ``r`` run on a host of ``cores`` cores, as it happens: the rank
    processes take the cores in turn (rank i on core i mod cores), so more ranks than cores
    share them."""
    if not r.cluster:
        return "every rank a thread of one process, sharing the host's cores"
    what = "a process of a jax.distributed launch (pdjax.cluster.launch), the executor multi-controller"
    if r.ranks <= cores:
        return f"each rank {what}, pinned to a core of its own ({r.ranks} ranks on {cores} cores)"
    return (f"{r.ranks} ranks on {cores} cores, shared: each rank {what}, pinned to core (rank mod {cores}), "
            "so ranks on one core slow each other")


def _measure(c: Config, mcfg, tokens, params) -> list:
    from pdjax.pipeline.measurement import measure_schedule

    rows = []
    for name in progress.track(c.run.schedules, "executed_bubbles: schedules (compile, time, simulate)"):
        row = measure_schedule(name, mcfg, num_ranks=c.run.ranks, num_microbatches=c.run.microbatches,
                               params=params, tokens=tokens, repeats=c.run.repeats, op_repeats=c.run.op_repeats,
                               cluster=c.run.cluster)
        rows.append(row)
        progress.note(f"{name}: measured {row.measured_makespan_ms:.1f} ms, simulated "
                      f"{row.simulated_makespan_ms:.1f} ms ({100 * row.makespan_error:+.1f}%)")
    return rows


def run(c: Config, out_dir: str) -> Result:
    import jax
    import numpy as np

    import pdjax
    from pdjax.pipeline.measurement import COLUMNS, plot_pair

    mcfg = model_config(c.model, c.scale)
    shape = (c.run.microbatches * c.batch.rows * c.scale, c.batch.seq_len * c.scale)
    params = pdjax.init_params(mcfg, jax.random.key(c.model.seed))
    tokens = np.random.default_rng(c.batch.seed).integers(0, mcfg.vocab_size, shape, dtype=np.int32)
    rows = _measure(c, mcfg, tokens, params)
    dicts = [r.as_dict() for r in rows]
    setup = {"backend": jax.default_backend(), "model": dataclasses.asdict(c.model), "scale": c.scale,
             "hidden_size": mcfg.hidden_size, "batch": list(shape), "rows_per_microbatch": c.batch.rows * c.scale,
             "cluster": c.run.cluster}
    plots = {r.schedule: f"{r.schedule}.png" for r in rows}
    where = placement(c.run, host_cores())
    with open(os.path.join(out_dir, "executed_bubbles.json"), "w") as f:
        json.dump({"headline": headline(rows), "setup": {**setup, "placement": where, "devices": [str(d) for d in
                   jax.devices()[:c.run.ranks]]}, "rows": dicts, "plots": plots}, f, indent=2, default=str)
    about = (f"Model {c.model.preset} x{c.scale} (hidden {mcfg.hidden_size}, {c.model.layers} layers), batch "
             f"{shape[0]} x {shape[1]} tokens ({c.batch.rows * c.scale} rows per micro-batch), one "
             f"{'cpu' if c.run.cluster else setup['backend']} device per rank; {where}.")
    body = (f"{about}\n\n{report_table(rows)}\n{MEASURED_NOTE} Per-op costs (ms) and every step's makespan: "
            "[executed_bubbles.json](executed_bubbles.json).")
    return Result("Executed pipeline schedules: measured vs simulated bubbles", headline(rows),
                  metrics={"setup": setup, "rows": [{k: d[k] for k in REPRODUCIBLE} for d in dicts]},
                  wall_clock={d["schedule"]: {k: v for k, v in d.items()
                                              if k not in REPRODUCIBLE and not isinstance(v, (list, dict))}
                              for d in dicts},
                  tables={"executed_bubbles": [{k: d[k] for k in COLUMNS} for d in dicts]},
                  measured_tables=("executed_bubbles",),
                  figures={r.schedule: plot_pair(r) for r in rows}, body=body,
                  objects={"row_objects": rows, "plots": plots})
