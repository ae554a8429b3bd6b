"""Experiment: pipeline schedules executed as real training steps, against their simulation.

For every schedule of the config, :func:`pdjax.pipeline.executed.measure_schedule` runs the
model's training step with the :class:`pdjax.pipeline.Executor` (a measured timeline per
rank), times every op in isolation and simulates the schedule with those times and the
executor's byte model. ``[run] processes = true`` (the default) runs each rank in a process
of its own pinned to one CPU core (:class:`pdjax.pipeline.RankProcesses`), so ranks do not
share cores; ``false`` runs every rank as a thread of this process (on accelerators, where
a rank is a device). The run directory gets ``<schedule>.png`` (measured over simulated
Gantt chart, one time axis), ``executed_bubbles.csv`` / ``executed_bubbles.json`` (one row
per schedule) and ``report.md``.

``[run] scale`` (a positive int) multiplies the model width (hidden size, FFN and expert
FFN sizes, LoRA ranks, attention heads), the sequence length and the rows per micro-batch,
so the same config runs larger on real accelerators unchanged: ``scale = 1`` is sized for
a 2-core CPU, ``scale = 8`` gives ``small``-preset widths with 256-token sequences.
"""

from __future__ import annotations

import csv
import json
import os

from pdjax.experiments import progress
from pdjax.experiments.runner import with_defaults

DEFAULTS = {
    "run": {"schedules": ["1f1b", "zb1p", "dualpipe", "dualpipev"], "ranks": 2, "microbatches": 8,
            "repeats": 3, "op_repeats": 3, "scale": 1, "processes": True},
    "model": {"preset": "tiny", "layers": 4, "dense_layers": 1, "seed": 0},
    "batch": {"rows": 4, "seq_len": 32, "seed": 1},
}
TOP_LEVEL = {"kind", "name", "description"}
WIDTH_FIELDS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank",
                "kv_lora_rank", "num_attention_heads")


def _int(sec: str, key: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"executed_bubbles config [{sec}] {key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_config(cfg: dict) -> dict:
    """The config's tables merged over :data:`DEFAULTS`; unknown tables or keys and bad values
    raise ValueError naming them."""
    unknown = set(cfg) - TOP_LEVEL - set(DEFAULTS)
    if unknown:
        raise ValueError(f"executed_bubbles config has unknown keys or tables {sorted(unknown)}")
    out = with_defaults(cfg, DEFAULTS, "executed_bubbles")
    from pdjax.schedules import GENERATORS

    names = out["run"]["schedules"]
    if not isinstance(names, list) or not names or any(n not in GENERATORS for n in names):
        raise ValueError(f"executed_bubbles config [run] schedules must be a non-empty list of "
                         f"{sorted(GENERATORS)}, got {names!r}")
    for sec, key in (("run", "ranks"), ("run", "microbatches"), ("run", "repeats"), ("run", "op_repeats"),
                     ("run", "scale"), ("model", "layers"), ("batch", "rows"), ("batch", "seq_len")):
        _int(sec, key, out[sec][key])
    for sec, key in (("model", "dense_layers"), ("model", "seed"), ("batch", "seed")):
        _int(sec, key, out[sec][key], minimum=0)
    if not isinstance(out["run"]["processes"], bool):
        raise ValueError(f"executed_bubbles config [run] processes must be true or false, got {out['run']['processes']!r}")
    return out


def model_config(model: dict, scale: int):
    """The preset with ``layers`` decoder layers (the first ``dense_layers`` dense) and its
    widths multiplied by ``scale``."""
    import pdjax

    base = pdjax.configs.preset(model["preset"])
    widths = {f: getattr(base, f) * scale for f in WIDTH_FIELDS if getattr(base, f) is not None}
    return base.replace(num_hidden_layers=model["layers"], first_k_dense_replace=model["dense_layers"],
                        **widths)


def run_executed_bubbles(cfg: dict, out_dir: str) -> dict:
    """Run the experiment into ``out_dir``; returns a summary: ``rows`` (one dict per schedule),
    ``row_objects`` (the :class:`pdjax.pipeline.executed.ExecutedRow` s, with their timelines),
    ``headline``, ``plots`` and the file paths."""
    import jax
    import numpy as np

    import pdjax
    from pdjax.pipeline.executed import measure_schedule, plot_pair

    c = parse_config(cfg)
    run, batch, scale = c["run"], c["batch"], c["run"]["scale"]
    mcfg = model_config(c["model"], scale)
    rows_per_mb, T = batch["rows"] * scale, batch["seq_len"] * scale
    shape = (run["microbatches"] * rows_per_mb, T)
    params = pdjax.init_params(mcfg, jax.random.key(c["model"]["seed"]))
    tokens = np.random.default_rng(batch["seed"]).integers(0, mcfg.vocab_size, shape, dtype=np.int32)
    os.makedirs(out_dir, exist_ok=True)
    rows, plots = [], {}
    for name in progress.track(run["schedules"], "executed_bubbles: schedules (compile, time, simulate)"):
        row = measure_schedule(name, mcfg, num_ranks=run["ranks"], num_microbatches=run["microbatches"],
                               params=params, tokens=tokens, repeats=run["repeats"], op_repeats=run["op_repeats"],
                               processes=run["processes"])
        plots[name] = f"{name}.png"
        plot_pair(row, os.path.join(out_dir, plots[name]))
        rows.append(row)
        progress.note(f"{name}: measured {row.measured_makespan_ms:.1f} ms, simulated "
                      f"{row.simulated_makespan_ms:.1f} ms ({100 * row.makespan_error:+.1f}%)")
    setup = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()[:run["ranks"]]],
             "model": c["model"], "scale": scale, "hidden_size": mcfg.hidden_size, "batch": list(shape),
             "rows_per_microbatch": rows_per_mb, "processes": run["processes"]}
    summary = _write(rows, plots, setup, out_dir)
    summary["row_objects"] = rows       # with their timelines; not in the JSON file
    return summary


def headline(rows) -> str:
    import numpy as np

    errors = [abs(r.makespan_error) for r in rows]
    parts = ", ".join(f"{r.schedule} {100 * r.measured_bubble_ratio:.1f}% (sim {100 * r.simulated_bubble_ratio:.1f}%)"
                      for r in rows)
    same = all(r.measured_peak_bytes == r.simulated_peak_bytes for r in rows)
    return (f"measured bubble ratio at {rows[0].ranks} ranks x {rows[0].microbatches} micro-batches: {parts}; "
            f"median |makespan error| of the simulation fed with isolated op times {100 * float(np.median(errors)):.1f}%; "
            f"measured peak memory {'equals' if same else 'DIFFERS from'} the simulated byte model")


def _write(rows, plots: dict, setup: dict, out_dir: str) -> dict:
    from pdjax.pipeline.executed import COLUMNS, markdown_table

    dicts = [r.as_dict() for r in rows]
    csv_path = os.path.join(out_dir, "executed_bubbles.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for d in dicts:
            w.writerow({k: (" ".join(map(str, d[k])) if isinstance(d[k], list) else d[k]) for k in COLUMNS})
    json_path = os.path.join(out_dir, "executed_bubbles.json")
    summary = {"headline": headline(rows), "setup": setup, "rows": dicts, "plots": plots,
               "csv": csv_path, "json": json_path}
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=2, default=str)
    about = (f"Model {setup['model']['preset']} x{setup['scale']} (hidden {setup['hidden_size']}, "
             f"{setup['model']['layers']} layers), batch {setup['batch'][0]} x {setup['batch'][1]} tokens "
             f"({setup['rows_per_microbatch']} rows per micro-batch), one {setup['backend']} device per rank"
             + (", each rank a process of its own pinned to one core. " if setup["processes"]
                else ", every rank a thread of one process. ") +
             "Measured: the median-makespan step of the executor's instrumented run; simulated: "
             "`pdjax.schedules.simulate` fed with every op's median time measured in isolation.")
    lines = ["# Executed pipeline schedules: measured vs simulated bubbles", "", summary["headline"] + ".", "",
             about, "", markdown_table(rows), "Per-op costs (ms) and every step's makespan: executed_bubbles.json.", ""]
    for name, png in plots.items():
        lines += [f"### {name}", "", f"![{name}: measured (top) vs simulated (bottom)]({png})", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    return summary
