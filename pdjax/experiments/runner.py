"""Experiment configs and the runner.

An experiment config is a TOML file with a top-level ``kind`` (which experiment), a
``name`` (the run directory prefix) and kind-specific tables. ``run(path)`` loads it,
validates it, runs the experiment into ``runs/<name>-<YYYYmmdd-HHMMSS>/`` and returns its
summary dict; each experiment writes a ``report.md`` there.
"""

from __future__ import annotations

import datetime
import json
import os
import tomllib
from typing import Callable


def with_defaults(cfg: dict, defaults: dict, kind: str) -> dict:
    """Each table of ``defaults`` updated with the config's table of the same name; unknown
    keys raise ValueError naming the table."""
    out = {}
    for sec, d in defaults.items():
        given = cfg.get(sec, {})
        unknown = set(given) - set(d)
        if unknown:
            raise ValueError(f"{kind} config [{sec}] has unknown keys {sorted(unknown)}")
        out[sec] = {**d, **given}
    return out


def _quickstart(cfg, out_dir):
    from pdjax.experiments.quickstart import run_quickstart
    return run_quickstart(cfg, out_dir)


def _bubble_sweep(cfg, out_dir):
    from pdjax.pipeline.sweep import run_bubble_sweep
    summary = run_bubble_sweep({k: cfg[k] for k in ("sweep", "costs") if k in cfg}, out_dir)
    lines = ["# Pipeline bubble sweep", "", summary["headline"], "",
             "Simulated vs closed-form bubble per schedule x P x m: bubble_sweep.csv; plot: "
             "bubble_sweep.png.", "", "```", json.dumps(summary, indent=2, default=str), "```", ""]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:3]))
    return summary


def _dbo_sweep(cfg, out_dir):
    from pdjax.experiments.dbo_sweep import run_dbo_sweep
    return run_dbo_sweep(cfg, out_dir)


def _pd_vs_colocated(cfg, out_dir):
    from pdjax.experiments.pd_vs_colocated import run_pd_vs_colocated
    return run_pd_vs_colocated(cfg, out_dir)


def _executed_bubbles(cfg, out_dir):
    from pdjax.experiments.executed_bubbles import run_executed_bubbles
    return run_executed_bubbles(cfg, out_dir)


def _sim(kind):
    def run(cfg, out_dir):
        from pdjax.sim.experiments import RUNNERS
        return RUNNERS[kind](cfg, out_dir)
    return run


EXPERIMENTS: dict[str, Callable[[dict, str], dict]] = {
    "quickstart": _quickstart,
    "bubble_sweep": _bubble_sweep,
    "dbo_sweep": _dbo_sweep,
    "pd_vs_colocated": _pd_vs_colocated,
    "executed_bubbles": _executed_bubbles,
    # serving simulation (pdjax.sim)
    **{k: _sim(k) for k in ("colocated_vs_pd", "pd_ratio_sweep", "afd_ratio_sweep", "link_bandwidth",
                            "prefix_cache_capacity")},
}


def load_config(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no experiment config at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"malformed experiment config {path}: {e}") from None
    kind = cfg.get("kind")
    if kind not in EXPERIMENTS:
        raise ValueError(f"{path}: 'kind' must be one of {sorted(EXPERIMENTS)}, got {kind!r}")
    name = cfg.setdefault("name", kind)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{path}: 'name' must be a non-empty string without '/', got {name!r}")
    return cfg


def run(path: str, runs_dir: str = "runs") -> tuple[str, dict]:
    """Run the experiment at ``path``. Returns (run directory, summary)."""
    cfg = load_config(path)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(runs_dir, f"{cfg['name']}-{stamp}")
    os.makedirs(out_dir, exist_ok=True)
    summary = EXPERIMENTS[cfg["kind"]](cfg, out_dir)
    return out_dir, summary
