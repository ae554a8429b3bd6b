"""Pipeline parallelism on devices: a schedule of :mod:`pdjax.schedules` run as real
training steps of the pdjax model, one stage program per (rank, stage), ranks on devices
(or processes), with measured timelines and memory.

    ex = Executor(build("dualpipe", 4, 8), cfg, devices=jax.devices()[:4])
    loss, grads = ex.step(params, tokens)
    state = train(build("zb1p", 2, 4), cfg, params, batches, steps=10)

The schedules themselves (IR, generators, validator, simulator, search, plots: pure
Python) live in :mod:`pdjax.schedules`; their face is here too, so one import serves a
notebook. See docs/pipeline.md.
"""

import importlib
import sys

from pdjax.deprecation import package_getattr
from pdjax.schedules import (DeadlockError, Layout, Schedule, ScheduleError, SearchResult, Timeline,
                             bubble_formula, build, compare, format_report, formula_conditions, lower_bound,
                             memory_table, plot, search, simulate, stage_costs, validate)

from .executed import measure_schedule
from .executor import Executor
from .processes import RankProcesses
from .stages import next_token_loss, split_layers
from .training import TrainState, train

__all__ = [
    "DeadlockError", "Executor", "Layout", "RankProcesses", "Schedule", "ScheduleError", "SearchResult",
    "Timeline", "TrainState", "bubble_formula", "build", "compare", "format_report", "formula_conditions",
    "lower_bound", "measure_schedule", "memory_table", "next_token_loss", "plot", "search", "simulate",
    "split_layers", "stage_costs", "train", "validate",
]

# ---- deprecated aliases (kept for one release) ----------------------------------------------
# The schedule modules moved from pdjax.pipeline to pdjax.schedules (the pure side); the names
# that left the face stay reachable here, with a DeprecationWarning naming their new home.
_MOVED_MODULES = ("bound", "comms", "csvio", "dualpipe", "formulas", "gantt", "generators", "greedy", "layout",
                  "measured", "milp", "ops", "schedule", "search", "simulate", "validate", "vblock")
for _name in _MOVED_MODULES:
    sys.modules.setdefault(f"{__name__}.{_name}", importlib.import_module(f"pdjax.schedules.{_name}"))
sys.modules.setdefault(f"{__name__}.engine", importlib.import_module("pdjax.schedules.program"))
sys.modules.setdefault(f"{__name__}.report", importlib.import_module("pdjax.schedules.comparison"))

_DEPRECATED = {
    **dict.fromkeys(("AnyOp", "B", "F", "FB", "I", "Op", "OverlapFB", "W", "parse_op"), "ops"),
    **dict.fromkeys(("CommAction", "comm_volume", "derive_comms"), "comms"),
    **dict.fromkeys(("GENERATORS", "gpipe", "interleaved_1f1b", "one_f_one_b", "zb1p"), "generators"),
    **dict.fromkeys(("dualpipe", "dualpipev"), "dualpipe"),
    **dict.fromkeys(("bubble_ratio_1f1b", "dualpipe_bubble", "dualpipe_makespan", "min_microbatches_1f1b"),
                    "formulas"),
    "Pipeline": "layout", "ReportRow": "comparison", "compare_one": "comparison",
    "Event": "simulate", "measured_timeline": "simulate", "Candidate": "search", "pareto": "search",
    **dict.fromkeys(("Policy", "greedy_schedule", "span_bubble", "zbh2", "zbv"), "greedy"),
    **dict.fromkeys(("building_block", "v_half", "v_min"), "vblock"),
}
# the bubble sweep is an experiment now (one module per kind); its old entry point is found by
# name at call time (an experiment is above the runtime, so nothing here imports it)
_DEPRECATED_ELSEWHERE = {"run_bubble_sweep": "pdjax.experiments.bubble_sweep"}


__getattr__ = package_getattr(__name__, {**{name: f"pdjax.schedules.{module}" for name, module in _DEPRECATED.items()},
                                         **_DEPRECATED_ELSEWHERE})
