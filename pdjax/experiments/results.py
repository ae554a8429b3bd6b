"""What an experiment returns (:class:`Result`) and how a run directory is written and reported.

A run directory ``runs/<name>/<timestamp>/`` holds:

* ``config.json``: the resolved config (every default filled in, ``--set`` overrides applied);
* ``metrics.json``: ``metrics`` (the same config and seeds give the same values),
  ``wall_clock`` (measured times: they differ between runs and machines), the index of the
  tables and figures, the headline and the experiment's own markdown;
* ``<table>.csv`` for every table, ``<figure>.png`` and ``<figure>.svg`` for every figure;
* ``report.md``: :func:`render_report` of the above. It reads only the saved files, so
  ``pdjax report <run dir>`` rebuilds it without recomputing anything;
* while the experiment runs, ``RUNNING``; after an error, ``FAILED`` (:mod:`rundir`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Any

from pdjax.experiments import rundir

CONFIG_FILE, METRICS_FILE, REPORT_FILE = "config.json", "metrics.json", "report.md"


@dataclasses.dataclass
class Result:
    """An experiment's outcome. ``metrics``: reproducible numbers (JSON-ready); ``wall_clock``:
    measured times (seconds, ms, tokens/s: named with their unit); ``tables``: name -> rows
    (dicts), written as ``<name>.csv``; ``measured_tables``: the tables holding measured times;
    ``figures``: name -> matplotlib Figure, written as PNG and SVG; ``body``: markdown for the
    report (it may link the files above); ``objects``: in-memory extras for Python callers,
    never written. ``result[key]`` looks ``key`` up in metrics, wall_clock, then objects."""

    title: str
    headline: str
    metrics: dict = dataclasses.field(default_factory=dict)
    wall_clock: dict = dataclasses.field(default_factory=dict)
    tables: dict = dataclasses.field(default_factory=dict)
    measured_tables: tuple = ()
    figures: dict = dataclasses.field(default_factory=dict)
    body: str = ""
    objects: dict = dataclasses.field(default_factory=dict)

    def __getitem__(self, key):
        if key == "headline":
            return self.headline
        for d in (self.metrics, self.wall_clock, self.objects):
            if key in d:
                return d[key]
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return key == "headline" or any(key in d for d in (self.metrics, self.wall_clock, self.objects))


def write(result: Result, run_dir: str, dpi: int = 120) -> str:
    """Write ``result`` into ``run_dir`` (tables, figures, metrics.json, report.md); returns the
    report's path. ``config.json`` is the runner's (a sub-run written by an experiment has
    none)."""
    import matplotlib

    os.makedirs(run_dir, exist_ok=True)
    tables = {}
    for name, rows in result.tables.items():
        path = f"{name}.csv"
        write_csv(rows, os.path.join(run_dir, path))
        tables[name] = {"csv": path, "rows": len(rows), "wall_clock": name in result.measured_tables}
    figures = {}
    for name, fig in result.figures.items():
        figures[name] = {"png": f"{name}.png", "svg": f"{name}.svg"}
        fig.savefig(os.path.join(run_dir, figures[name]["png"]), dpi=dpi, metadata={"Software": None})
        with matplotlib.rc_context({"svg.hashsalt": name}):       # stable element ids: same plot, same file
            fig.savefig(os.path.join(run_dir, figures[name]["svg"]), metadata={"Date": None})
    saved = {"title": result.title, "headline": result.headline, "metrics": result.metrics,
             "wall_clock": result.wall_clock, "tables": tables, "figures": figures, "body": result.body}
    tmp = os.path.join(run_dir, METRICS_FILE + ".tmp")         # whole or absent, never half written
    with open(tmp, "w") as f:
        json.dump(saved, f, indent=2, default=_jsonable)
        f.write("\n")
    os.replace(tmp, os.path.join(run_dir, METRICS_FILE))
    return write_report(run_dir)


def write_csv(rows: list[dict], path: str) -> None:
    """``rows`` as CSV, columns in first-seen order; lists as space-separated values, tables
    as JSON."""
    keys: list = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(v) for k, v in r.items()})


def write_report(run_dir: str) -> str:
    """Write ``report.md`` of ``run_dir`` from its saved files; returns its path."""
    path = os.path.join(run_dir, REPORT_FILE)
    text = render_report(run_dir)
    with open(path, "w") as f:
        f.write(text)
    return path


def render_report(run_dir: str) -> str:
    """The markdown report of a run directory, from ``metrics.json``, ``config.json`` (when
    present) and the files there; links are relative to the directory."""
    try:
        with open(os.path.join(run_dir, METRICS_FILE)) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE} (not a pdjax run directory)") from None
    run_cfg = {}
    if os.path.exists(os.path.join(run_dir, CONFIG_FILE)):
        with open(os.path.join(run_dir, CONFIG_FILE)) as f:
            run_cfg = json.load(f)
    cfg = run_cfg.get("config", {})
    lines = [f"# {saved['title']}", ""]
    if cfg.get("description"):
        lines += [cfg["description"], ""]
    lines += [f"**{saved['headline']}**", ""]
    if saved.get("body"):
        lines += [saved["body"].rstrip(), ""]
    if saved["figures"]:
        lines += ["## Figures", ""]
        for name, files in saved["figures"].items():
            lines += [f"![{name}]({files['png']})", "", f"{name}: [PNG]({files['png']}), [SVG]({files['svg']})", ""]
    scalars = _flatten(saved["metrics"])
    if scalars:
        lines += ["## Metrics", "", "Reproducible: the same config and seeds give the same values.", "",
                  "| metric | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in scalars] + [""]
    timings = _flatten(saved["wall_clock"])
    if timings:
        lines += ["## Wall-clock measurements", "",
                  "Measured on this machine: they vary between runs and are not part of the reproducible metrics.",
                  "", "| measurement | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in timings] + [""]
    lines += ["## Files", ""]
    if run_cfg:
        sets = "".join(f" --set '{s}'" for s in run_cfg.get("overrides", []))
        lines.append(f"- [{CONFIG_FILE}]({CONFIG_FILE}): the resolved config "
                     f"(`pdjax run {run_cfg.get('source', '?')}{sets}`)")
    lines.append(f"- [{METRICS_FILE}]({METRICS_FILE}): `metrics` (reproducible), `wall_clock` (measured), "
                 "the table and figure index")
    for name, t in saved["tables"].items():
        lines.append(f"- [{t['csv']}]({t['csv']}): {name}, {t['rows']} rows"
                     + (" (measured times: vary between runs)" if t["wall_clock"] else ""))
    listed = {CONFIG_FILE, METRICS_FILE, REPORT_FILE} | {t["csv"] for t in saved["tables"].values()} \
        | {p for files in saved["figures"].values() for p in files.values()}
    for rel in _files(run_dir):
        if rel not in listed:
            lines.append(f"- [{rel}]({rel})")
    lines += ["", "Rebuild this report from the saved files: `pdjax report <this directory>`.", ""]
    return "\n".join(lines)


def _files(run_dir: str) -> list[str]:
    """The files of a run directory, less its life-cycle markers (:mod:`rundir`)."""
    out = []
    for root, dirs, files in os.walk(run_dir):
        dirs.sort()
        for f in sorted(files):
            if root == run_dir and f in (rundir.RUNNING, rundir.FAILED):
                continue
            out.append(os.path.relpath(os.path.join(root, f), run_dir).replace(os.sep, "/"))
    return out


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """The scalar leaves of nested dicts as (dotted key, value); lists are left to the CSV and
    JSON files."""
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        elif not isinstance(v, (list, tuple)):
            out.append((key, v))
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return str(v).replace("|", "\\|")


def _cell(v):
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, default=_jsonable)
    return v


def _jsonable(v):
    """numpy scalars and arrays, tuples and sets for json.dump."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return str(v)


def markdown_table(rows: list[dict], columns=None) -> str:
    """``rows`` as a markdown table (floats to 4 significant digits)."""
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)     # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows])
