"""Pipeline-parallel schedules, pure Python (numpy; matplotlib for plots; no jax): one IR,
generators, validator, simulator, closed-form bubbles, search, plots and CSV.

    s = build("dualpipe", num_ranks=8, num_microbatches=20)
    s.validate()
    t = simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5)
    t.makespan, t.bubble, t.bubble_ratio, t.peak_activations
    plot(t, "dualpipe.png"); print(t.to_text())    # plot(t) or t as a notebook cell's last line: the chart
    res = search(num_ranks=8, num_microbatches=32, memory_budget=8)

Everything here is also on :mod:`pdjax.pipeline`, the runtime that executes a schedule on
devices. The names below are the face; the rest is importable from its module
(``pdjax.schedules.greedy.zbv``, ``pdjax.schedules.ops.OverlapFB``, ...). See
docs/pipeline.md.
"""

from .bound import lower_bound
from .comparison import compare, format_report
from .comms import derive_comms
from .formulas import bubble_formula, formula_conditions, memory_table
from .generators import GENERATORS, build
from .greedy import greedy_schedule
from .layout import Layout
from .ops import Op, parse_op
from .plotting import plot
from .program import DeadlockError
from .schedule import Schedule
from .search import SearchResult, search
from .simulate import Timeline, measured_timeline, simulate, stage_costs
from .validate import ScheduleError, validate


def __getattr__(name):
    """``Figure`` on first use: importing the schedules does not load matplotlib."""
    if name == "Figure":
        from .figure import Figure
        return Figure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeadlockError", "Figure", "GENERATORS", "Layout", "Op", "Schedule", "ScheduleError", "SearchResult", "Timeline",
    "bubble_formula", "build", "compare", "derive_comms", "format_report", "formula_conditions",
    "greedy_schedule", "lower_bound", "measured_timeline", "memory_table", "parse_op", "plot", "search",
    "simulate", "stage_costs", "validate",
]
