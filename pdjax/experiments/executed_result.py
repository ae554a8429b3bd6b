"""The executed_bubbles experiment (:mod:`pdjax.experiments.executed_bubbles`) under the
shared run-directory convention: its config is typed by its ``DEFAULTS`` with ``[run] scale``
lifted to the top-level ``scale``; its rows, Gantt charts (PNG and SVG) and report become a
:class:`Result`. Times are measured (``wall_clock``); the shapes and the measured and
simulated peak bytes are reproducible (``metrics``)."""

from __future__ import annotations

from pdjax.experiments import executed_bubbles as eb
from pdjax.experiments import schema
from pdjax.experiments.results import Result

CONFIG = schema.from_defaults(
    "executed_bubbles", {**eb.DEFAULTS, "run": {k: v for k, v in eb.DEFAULTS["run"].items() if k != "scale"}})
REPRODUCIBLE = ("schedule", "P", "ranks", "microbatches", "batch", "seq_len", "formula_applies",
                "measured_peak_bytes", "simulated_peak_bytes")


def _tables(cfg: dict) -> dict:
    """The config as :func:`executed_bubbles.run_executed_bubbles` reads it."""
    return {"run": {**cfg["run"], "scale": cfg.get("scale", 1)}, "model": cfg["model"], "batch": cfg["batch"]}


def check(cfg: dict) -> None:
    """Schedule names and integer ranges (ValueError naming the key)."""
    eb.parse_config(_tables(cfg))


def run(cfg: dict, out_dir: str) -> Result:
    from pdjax.pipeline.executed import COLUMNS, markdown_table, plot_pair

    summary = eb.run_executed_bubbles(_tables(cfg), out_dir)
    rows, dicts = summary["row_objects"], summary["rows"]
    metrics = {"setup": {k: v for k, v in summary["setup"].items() if k != "devices"},
               "rows": [{k: d[k] for k in REPRODUCIBLE} for d in dicts]}
    wall_clock = {d["schedule"]: {k: v for k, v in d.items()
                                  if k not in REPRODUCIBLE and not isinstance(v, (list, dict))}
                  for d in dicts}
    body = (markdown_table(rows) + "\nMeasured: the median-makespan step of the executor's instrumented run; "
            "simulated: `pdjax.schedules.simulate` fed with every op's median time measured in isolation. "
            "Per-op costs (ms) and every step's makespan: [executed_bubbles.json](executed_bubbles.json).")
    return Result("Executed pipeline schedules: measured vs simulated bubbles", summary["headline"],
                  metrics=metrics, wall_clock=wall_clock,
                  tables={"executed_bubbles": [{k: d[k] for k in COLUMNS} for d in dicts]},
                  measured_tables=("executed_bubbles",),
                  figures={name: plot_pair(row) for name, row in zip(summary["plots"], rows)}, body=body,
                  objects={"row_objects": rows, "plots": summary["plots"]})
