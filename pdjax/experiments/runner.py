"""Experiment configs and the runner.

An experiment config is a TOML file with the top-level keys of :class:`schema.Header`
(``kind``: which experiment; ``name``: the run directory, default the kind; ``description``;
``scale``: an integer >= 1 multiplying the experiment's size) and the tables of the kind's
schema. :func:`load_config` parses it against that schema before anything runs: unknown
keys, wrong types and out-of-range values raise ValueError naming the dotted key.
:func:`run` runs it into ``runs/<name>/<YYYYmmdd-HHMMSS>/`` (see :mod:`results` for what the
directory holds) and returns the directory and the experiment's :class:`results.Result`.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import os
import tomllib
from typing import Optional

from pdjax.experiments import progress, results, schema


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment kind, imported on first use from ``module``: ``schema`` names its config
    schema (a dataclass of its tables), ``runner`` its function ``(resolved config, run dir)
    -> Result`` and ``check`` (optional) a function ``(resolved config) -> None`` raising
    ValueError for what the types cannot say (e.g. a schedule name)."""

    module: str
    schema: str
    runner: str
    check: Optional[str] = None

    def attr(self, name: str):
        return getattr(importlib.import_module(self.module), name)


_SERVING = "pdjax.experiments.serving"
#: Experiment kind (a config's ``kind``) -> where its config schema and runner live.
EXPERIMENTS: dict[str, Experiment] = {
    "quickstart": Experiment("pdjax.experiments.quickstart", "CONFIG", "run_quickstart", "check_config"),
    "bubble_sweep": Experiment("pdjax.experiments.bubble_sweep", "Config", "run_bubble_sweep"),
    "dbo_sweep": Experiment("pdjax.experiments.dbo_sweep", "CONFIG", "run_dbo_sweep"),
    "pd_vs_colocated": Experiment("pdjax.experiments.pd_vs_colocated", "CONFIG", "run_pd_vs_colocated"),
    "afd_ratio": Experiment("pdjax.experiments.afd_ratio", "CONFIG", "run_afd_ratio", "check"),
    "executed_bubbles": Experiment("pdjax.experiments.executed_result", "CONFIG", "run", "check"),
    "schedule_search": Experiment("pdjax.experiments.schedule_search", "Config", "run", "check"),
    # serving simulation (pdjax.sim)
    "colocated_vs_pd": Experiment(_SERVING, "ColocatedVsPDConfig", "run_colocated_vs_pd"),
    "pd_ratio_sweep": Experiment(_SERVING, "PDRatioSweepConfig", "run_pd_ratio_sweep"),
    "afd_ratio_sweep": Experiment(_SERVING, "AFDRatioSweepConfig", "run_afd_ratio_sweep"),
    "link_bandwidth": Experiment(_SERVING, "LinkBandwidthConfig", "run_link_bandwidth"),
    "prefix_cache_capacity": Experiment(_SERVING, "PrefixCacheConfig", "run_prefix_cache_capacity"),
}


def with_defaults(cfg: dict, defaults: dict, kind: str) -> dict:
    """The tables of ``defaults`` (``{table: {key: default}}``) updated with the config's
    tables of the same name, typed by their defaults (:func:`schema.from_defaults`): unknown
    keys and wrong types raise ValueError naming ``table.key``."""
    cls = schema.from_defaults(kind, defaults)
    return schema.to_dict(schema.parse(cls, {k: cfg[k] for k in defaults if k in cfg}))


def resolve(cfg: dict) -> dict:
    """``cfg`` (a parsed TOML dict) checked against its kind's schema, every default filled
    in: the resolved config the experiment runs with and ``config.json`` records."""
    kind = cfg.get("kind")
    if kind not in EXPERIMENTS:
        raise ValueError(f"kind: must be one of {', '.join(sorted(EXPERIMENTS))}; got {kind!r}")
    exp = EXPERIMENTS[kind]
    tables_cls = exp.attr(exp.schema)
    header_keys = [f.name for f in dataclasses.fields(schema.Header)]
    table_keys = [f.name for f in dataclasses.fields(tables_cls)]
    for key in cfg:
        if key not in header_keys and key not in table_keys:
            raise ValueError(f"{key}: unknown key (known: {', '.join(header_keys + table_keys)})")
    header = schema.parse(schema.Header, {"name": kind, **{k: cfg[k] for k in header_keys if k in cfg}})
    tables = schema.parse(tables_cls, {k: cfg[k] for k in table_keys if k in cfg})
    resolved = {**schema.to_dict(header), **schema.to_dict(tables)}
    if exp.check:
        exp.attr(exp.check)(resolved)
    return resolved


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


def load_config(path: str, overrides=None) -> dict:
    """The resolved config (:func:`resolve`) at ``path`` with ``overrides`` (``"table.key=value"``
    strings) applied. Errors are ValueError ``"<path>: <dotted key>: <what is wrong>"``."""
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no experiment config at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"malformed experiment config {path}: {e}") from None
    cfg = apply_overrides(cfg, overrides)
    try:
        return resolve(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def new_run_dir(runs_dir: str, name: str) -> str:
    """A fresh ``<runs_dir>/<name>/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(runs_dir, name, stamp)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for n in range(1, 1000):
        candidate = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {os.path.dirname(base)}")


def run(path: str, runs_dir: str = "runs", overrides=None, show_progress: bool = False
        ) -> tuple[str, results.Result]:
    """Run the experiment at ``path`` (with ``overrides``, see :func:`apply_overrides`): the
    config is resolved (and any error raised) before the run directory is made. Returns (run
    directory, Result); ``show_progress`` draws progress bars on stderr."""
    cfg = load_config(path, overrides)
    exp = EXPERIMENTS[cfg["kind"]]
    runner = exp.attr(exp.runner)
    run_dir = new_run_dir(runs_dir, cfg["name"])
    with open(os.path.join(run_dir, results.CONFIG_FILE), "w") as f:
        json.dump({"source": os.path.abspath(path), "overrides": list(overrides or ()), "config": cfg}, f,
                  indent=2)
        f.write("\n")
    with progress.bars(enabled=show_progress):
        result = runner(cfg, run_dir)
    results.write(result, run_dir)
    return run_dir, result


def report(run_dir: str) -> str:
    """Rebuild ``report.md`` of a run directory from its saved files (nothing is recomputed);
    returns its path."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"no run directory {run_dir}")
    return results.rebuild_report(run_dir)


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
