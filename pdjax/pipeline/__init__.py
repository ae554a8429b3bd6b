"""Pipeline-parallel schedules: one IR, generators, validator, simulator, formulas, plots.

    s = build("dualpipe", num_ranks=8, num_microbatches=20)
    s.validate()
    t = simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5)
    t.makespan, t.bubble, t.bubble_ratio, t.peak_activations
    plot(t, "dualpipe.png"); print(t.to_text())

Pure Python + numpy (matplotlib only when plotting); no jax, except the executor and the
training loop (``Executor``, ``train``), loaded on first use. See docs/pipeline.md.
"""

from .comms import CommAction, comm_volume, derive_comms
from .dualpipe import dualpipe, dualpipev
from .engine import DeadlockError
from .formulas import (bubble_formula, bubble_ratio_1f1b, dualpipe_bubble, dualpipe_makespan,
                       formula_conditions, memory_table, min_microbatches_1f1b)
from .generators import GENERATORS, build, gpipe, interleaved_1f1b, one_f_one_b, zb1p
from .greedy import Policy, greedy_schedule, span_bubble, zbh2, zbv
from .vblock import building_block, v_half, v_min
from .bound import lower_bound
from .search import Candidate, SearchResult, pareto, search
from .layout import Layout, Pipeline
from .ops import FB, AnyOp, B, F, I, Op, OverlapFB, W, parse_op
from .report import ReportRow, compare, compare_one, format_report
from .schedule import Schedule
from .simulate import Event, Timeline, measured_timeline, simulate, stage_costs
from .validate import ScheduleError, validate


_LAZY = {"Executor": "executor", "next_token_loss": "stages", "split_layers": "stages",
         "train": "training", "TrainState": "training", "RankProcesses": "processes"}


def __getattr__(name):
    """The executor and training loop need jax and the model: loaded on first use only."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plot(timeline_or_schedule, path=None, **simulate_kwargs):
    """Gantt chart (PNG/SVG/PDF by suffix) of a Timeline or Schedule; see ``plot.plot``."""
    from .gantt import plot as _plot

    return _plot(timeline_or_schedule, path, **simulate_kwargs)


def run_bubble_sweep(config_dict, out_dir):
    """The bubble-sweep experiment; see ``sweep.run_bubble_sweep``."""
    from .sweep import run_bubble_sweep as _run

    return _run(config_dict, out_dir)


__all__ = [
    "AnyOp", "B", "Executor", "RankProcesses", "TrainState", "next_token_loss", "split_layers", "train", "CommAction", "DeadlockError", "Event", "F", "FB", "GENERATORS", "I", "Layout",
    "Op", "OverlapFB", "Pipeline", "ReportRow", "Schedule", "ScheduleError", "Timeline", "W",
    "bubble_formula", "bubble_ratio_1f1b", "build", "comm_volume", "compare", "compare_one",
    "derive_comms", "dualpipe", "dualpipe_bubble", "dualpipe_makespan", "dualpipev",
    "format_report", "formula_conditions", "gpipe", "interleaved_1f1b", "memory_table",
    "min_microbatches_1f1b", "one_f_one_b", "parse_op", "plot", "run_bubble_sweep", "simulate",
    "measured_timeline", "stage_costs", "validate", "zb1p",
    "Candidate", "Policy", "SearchResult", "greedy_schedule", "lower_bound", "pareto", "search",
    "building_block", "span_bubble", "v_half", "v_min", "zbh2", "zbv",
]
