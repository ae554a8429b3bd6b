"""Experiment configs and the runner.

An experiment config is a TOML file with the top-level keys of :class:`schema.Header`
(``kind``: which experiment; ``name``: the run directory, default the kind; ``description``;
``scale``: an integer >= 1 multiplying the experiment's size) and the tables of the kind's
schema. Each kind's config ships with pdjax as ``pdjax/experiments/configs/<kind>.toml``, so
``pdjax run <kind>`` works from any directory; a path to a TOML file works too.

:func:`load_config` parses a config against its kind's schema: unknown keys, wrong types,
numbers that are not finite and out-of-range values raise ValueError naming the dotted key.
:func:`run` does that, and checks the devices the experiment needs, before the run
directory ``runs/<name>/<YYYYmmdd-HHMMSS>/`` exists (see :mod:`results` for what it holds);
an error after that leaves the directory marked ``FAILED`` (:mod:`rundir`) and raises
:class:`rundir.RunFailed`. It returns the directory and the experiment's
:class:`results.Result`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import json
import os
import tomllib

from pdjax.experiments import progress, results, rundir, schema

#: The experiment kinds, each the module ``pdjax.experiments.<kind>`` and the shipped config
#: ``pdjax/experiments/configs/<kind>.toml``.
KINDS = ("quickstart", "bubble_sweep", "dbo_sweep", "pd_vs_colocated", "afd_ratio", "executed_bubbles",
         "schedule_search", "sim_pd_vs_colocated", "pd_ratio_sweep", "afd_ratio_sweep", "link_bandwidth",
         "prefix_cache_capacity", "deployment_validation", "mtp_speculative", "dsa_context_sweep")


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment kind: its module ``pdjax.experiments.<kind>`` (imported on first use)
    holds its config schema ``Config`` (a :class:`schema.Header` subclass whose
    ``__post_init__`` checks what the types cannot say, and whose optional
    ``devices_needed()`` says how many jax devices it runs on) and ``run(config, run_dir) ->
    Result``."""

    kind: str

    @property
    def module(self):
        return importlib.import_module(f"pdjax.experiments.{self.kind}")

    @property
    def schema(self) -> type:
        return self.module.Config

    @property
    def runner(self):
        return self.module.run


#: Experiment kind (a config's ``kind``) -> where its config schema and runner live.
EXPERIMENTS: dict[str, Experiment] = {kind: Experiment(kind) for kind in KINDS}


def shipped_configs():
    """The directory of the configs that ship with pdjax (an ``importlib.resources``
    Traversable: a plain directory for a normal install)."""
    return importlib.resources.files("pdjax.experiments").joinpath("configs")


def resolve(cfg: dict):
    """``cfg`` (a parsed TOML dict) checked against its kind's schema, every default filled
    in: the typed config the experiment runs with (``schema.to_dict`` of it is what
    ``config.json`` records)."""
    kind = cfg.get("kind")
    if kind not in EXPERIMENTS:
        raise ValueError(f"kind: must be one of {', '.join(sorted(EXPERIMENTS))}; got {kind!r}")
    return schema.parse(EXPERIMENTS[kind].schema, cfg)


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


def read_config(source: str) -> tuple[str, str]:
    """``(where, TOML text)`` of ``source``: the shipped config of that name (``where`` is
    the name), else a path to a TOML file (``where`` is the path). A directory, or a name
    that is neither, raises FileNotFoundError with a one-line message."""
    shipped = _shipped(source)
    if shipped is not None:
        return source, shipped.read_text()
    if os.path.isdir(source):
        raise FileNotFoundError(f"{source} is a directory, not an experiment config: give a TOML file or an "
                                "experiment name (pdjax list shows them)")
    try:
        with open(source) as f:
            return source, f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"no experiment config at {source}, and no experiment of that name "
                                "(pdjax list shows them)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FileNotFoundError(f"cannot read the experiment config {source}: {e}") from None


def _shipped(source: str):
    """The shipped config called ``source`` (a bare name: no directory, no ``.toml``), or None."""
    if not source or os.sep in source or "/" in source or source.endswith(".toml"):
        return None
    path = shipped_configs().joinpath(f"{source}.toml")
    return path if path.is_file() else None


def load_config(source: str, overrides=None):
    """The typed config (:func:`resolve`) of ``source`` (an experiment name or a TOML path,
    see :func:`read_config`) with ``overrides`` (``"table.key=value"`` strings) applied.
    Errors are ValueError ``"<source>: <dotted key>: <what is wrong>"``."""
    where, text = read_config(source)
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"malformed experiment config {where}: {e}") from None
    cfg = apply_overrides(cfg, overrides)
    try:
        return resolve(cfg)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def check_devices(config) -> None:
    """Raise ValueError when the experiment needs more jax devices than there are (its
    ``Config.devices_needed()``; ``pdjax run`` gives 8 simulated CPU devices)."""
    needed = config.devices_needed() if hasattr(config, "devices_needed") else 0
    if not needed:
        return
    import jax
    if jax.device_count() < needed:
        raise ValueError(f"{config.kind} needs {needed} devices, got {jax.device_count()} (on a CPU: "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts; `pdjax run` sets it)")


def run(source: str, runs_dir: str = "runs", overrides=None, show_progress: bool = False
        ) -> tuple[str, results.Result]:
    """Run the experiment ``source`` (an experiment name or a TOML path) with ``overrides``
    (see :func:`apply_overrides`). Every check of the config and the devices runs before the
    run directory is made; an error after that marks the directory ``FAILED`` and raises
    :class:`rundir.RunFailed` from it. Returns (run directory, Result); ``show_progress``
    draws progress bars on stderr."""
    config = load_config(source, overrides)
    check_devices(config)
    run_dir = rundir.new(runs_dir, config.name)
    with rundir.running(run_dir):
        with open(os.path.join(run_dir, results.CONFIG_FILE), "w") as f:
            json.dump({"source": source if _shipped(source) is not None else os.path.abspath(source),
                       "overrides": list(overrides or ()), "config": schema.to_dict(config)}, f, indent=2)
            f.write("\n")
        with progress.bars(enabled=show_progress):
            result = EXPERIMENTS[config.kind].runner(config, run_dir)
        results.write(result, run_dir)
    return run_dir, result


def rebuild_report(run_dir: str) -> str:
    """Rebuild ``report.md`` of a run directory from its saved files (nothing is recomputed);
    returns its path. A directory marked ``FAILED`` (or still ``RUNNING``) raises
    :class:`rundir.RunFailed` saying so."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"no run directory {run_dir}")
    rundir.check_complete(run_dir)
    return results.write_report(run_dir)


def list_experiments(directory: str | None = None) -> list[tuple[str, str, str]]:
    """``(what to run, kind, description)`` of every experiment config: the shipped ones
    (by name) or, given ``directory``, its TOML files (by path). The description is the
    config's ``description`` or its first comment line."""
    if directory is None:
        entries = [(p.name.removesuffix(".toml"), p.read_text()) for p in shipped_configs().iterdir()
                   if p.name.endswith(".toml")]
    else:
        entries = []
        for fname in os.listdir(directory):
            if fname.endswith(".toml"):
                with open(os.path.join(directory, fname)) as f:
                    entries.append((os.path.join(directory, fname), f.read()))
    out = []
    for where, text in sorted(entries):
        try:
            cfg = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            out.append((where, "?", f"malformed: {e}"))
            continue
        out.append((where, str(cfg.get("kind", "?")), str(cfg.get("description") or _first_comment(text))))
    return out


def _first_comment(text: str) -> str:
    """A config's first comment line (its one-line summary when it has no description)."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""
