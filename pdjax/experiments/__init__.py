"""The ``pdjax run`` runner: experiments (one module each, their configs shipped in
``configs/<kind>.toml``) -> runs/<name>/<time>/ (config, metrics, tables, plots and
report.md, or a ``FAILED`` marker); see ``runner``, ``schema``, ``results`` and ``rundir``."""

from pdjax.experiments.results import Result
from pdjax.experiments.rundir import RunFailed
from pdjax.experiments.runner import EXPERIMENTS, load_config, rebuild_report, run

__all__ = ["EXPERIMENTS", "Result", "RunFailed", "load_config", "rebuild_report", "run"]
