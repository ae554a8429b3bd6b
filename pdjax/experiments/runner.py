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
    """Each table of ``defaults`` updated with the config's table of the same name. Unknown
    keys, and values whose type differs from the default's (an int where a float is due is
    fine), raise ValueError naming the table and key."""
    out = {}
    for sec, d in defaults.items():
        given = cfg.get(sec, {})
        if not isinstance(given, dict):
            raise ValueError(f"{kind} config: [{sec}] must be a table, got {given!r}")
        unknown = set(given) - set(d)
        if unknown:
            raise ValueError(f"{kind} config [{sec}] has unknown keys {sorted(unknown)}")
        for key, value in given.items():
            _check_type(kind, sec, key, value, d[key])
        out[sec] = {**d, **given}
    return out


def _check_type(kind: str, sec: str, key: str, value, default) -> None:
    if default is None:
        return
    want = type(default)
    ok = isinstance(value, want) and not (isinstance(value, bool) and want is not bool)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{kind} config [{sec}] {key} must be {want.__name__} like its default "
                         f"{default!r}, got {type(value).__name__} {value!r}")


def parse_override(text: str) -> tuple[list[str], object]:
    """``"table.key=value"`` -> (["table", "key"], value); the value is read as TOML (``8``,
    ``0.5``, ``true``, ``[1, 2]``, ``"1f1b"``), or taken as a bare string."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected key=value (e.g. sweep.num_stages=[4, 8])")
    key, raw = (part.strip() for part in text.split("=", 1))
    path = key.split(".")
    if not key or any(not part for part in path):
        raise ValueError(f"--set {text!r}: bad key {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(cfg: dict, overrides) -> dict:
    """The config with each ``table.key=value`` override set (tables created as needed)."""
    for text in overrides or ():
        path, value = parse_override(text)
        node = cfg
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {text!r}: {part!r} is not a table")
        node[path[-1]] = value
    return cfg


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


def load_config(path: str, overrides=None) -> dict:
    """The config at ``path`` with ``overrides`` (``"table.key=value"`` strings) applied."""
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no experiment config at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"malformed experiment config {path}: {e}") from None
    cfg = apply_overrides(cfg, overrides)
    kind = cfg.get("kind")
    if kind not in EXPERIMENTS:
        raise ValueError(f"{path}: 'kind' must be one of {sorted(EXPERIMENTS)}, got {kind!r}")
    name = cfg.setdefault("name", kind)
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"{path}: 'name' must be a non-empty string without '/', got {name!r}")
    return cfg


def run(path: str, runs_dir: str = "runs", overrides=None) -> tuple[str, dict]:
    """Run the experiment at ``path`` (with ``overrides``, see :func:`apply_overrides`).
    Returns (run directory, summary); the run directory holds ``config.json``, the config as
    run (overrides applied)."""
    cfg = load_config(path, overrides)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = os.path.join(runs_dir, f"{cfg['name']}-{stamp}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"source": os.path.abspath(path), "overrides": list(overrides or ()), "config": cfg},
                  f, indent=2, default=str)
    summary = EXPERIMENTS[cfg["kind"]](cfg, out_dir)
    return out_dir, summary


def list_experiments(directory: str = "experiments") -> list[tuple[str, str, str]]:
    """``(file, kind, description)`` of every experiment config in ``directory`` (the
    description is the config's ``description`` or its first comment line)."""
    out = []
    for fname in sorted(os.listdir(directory)):
        if not fname.endswith(".toml"):
            continue
        path = os.path.join(directory, fname)
        try:
            with open(path, "rb") as f:
                cfg = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            out.append((path, "?", f"malformed: {e}"))
            continue
        out.append((path, str(cfg.get("kind", "?")), str(cfg.get("description") or _first_comment(path))))
    return out


def _first_comment(path: str) -> str:
    """A config's first comment line (its one-line summary when it has no description)."""
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                return line.lstrip("#").strip()
    return ""
