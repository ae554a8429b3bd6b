"""The ``pdjax run`` runner: experiment configs (TOML) -> runs/<name>-<time>/ reports."""

from pdjax.experiments.runner import EXPERIMENTS, load_config, run

__all__ = ["EXPERIMENTS", "load_config", "run"]
