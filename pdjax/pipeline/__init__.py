"""Pipeline parallelism on devices: a schedule of :mod:`pdjax.schedules` run as real
training steps of the pdjax model, one stage program per (rank, stage), ranks on devices
(or processes of a ``jax.distributed`` launch), with measured timelines and memory.

    ex = Executor(build("dualpipe", 4, 8), cfg, devices=jax.devices()[:4])
    loss, grads = ex.step(params, tokens)
    state = train(build("zb1p", 2, 4), cfg, batches, steps=10)

The schedules themselves (IR, generators, validator, simulator, search, plots: pure
Python) live in :mod:`pdjax.schedules`; their face is here too, so one import serves a
notebook. See docs/pipeline.md.
"""

from pdjax.schedules import (DeadlockError, Layout, Schedule, ScheduleError, SearchResult, Timeline,
                             bubble_formula, build, compare, format_report, formula_conditions, lower_bound,
                             memory_table, plot, search, simulate, stage_costs, validate)
from pdjax.schedules.layer_split import split_layers

from .measurement import measure_schedule
from .executor import Executor
from .training import TrainState, train

__all__ = [
    "DeadlockError", "Executor", "Layout", "Schedule", "ScheduleError", "SearchResult",
    "Timeline", "TrainState", "bubble_formula", "build", "compare", "format_report", "formula_conditions",
    "lower_bound", "measure_schedule", "memory_table", "plot", "search", "simulate",
    "split_layers", "stage_costs", "train", "validate",
]
