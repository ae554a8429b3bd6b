"""The ``pdjax run`` runner: experiment configs (TOML) -> runs/<name>/<time>/ (config, metrics,
tables, plots and report.md); see ``runner``, ``schema`` and ``results``."""

from pdjax.experiments.results import Result
from pdjax.experiments.runner import EXPERIMENTS, load_config, report, run

__all__ = ["EXPERIMENTS", "Result", "load_config", "report", "run"]
