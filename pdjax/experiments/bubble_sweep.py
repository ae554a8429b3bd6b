"""Experiment: every pipeline schedule x P x m, simulated bubble vs its closed form.

Config (``pdjax run bubble_sweep``; configs/bubble_sweep.toml)::

    [sweep]
    schedules = ["gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev"]
    num_stages = [4, 8, 16, 32]          # P (DualPipeV runs P stages on P/2 ranks)
    microbatch_multipliers = [1, 2, 4, 8]  # m = k * P
    num_stages_per_rank = 2              # interleaved-1f1b only
    [costs]                              # per-op times, one unit (e.g. ms)
    F = 1.0
    B = 2.0
    W = 1.0
    FB = 2.5
    comm = 0.0

``scale`` multiplies every ``num_stages`` (m follows as multiplier x P). :func:`run` gives the
:class:`Result` (one row per schedule x P x m in ``bubble_sweep.csv``, the plot
``bubble_sweep``); :func:`grid`, :func:`sweep_row`, :func:`summarize` and :func:`figure` are
its parts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.experiments import progress
from pdjax.experiments.results import Result
from pdjax.experiments.schema import Header, knob, table
from pdjax.schedules.comparison import ReportRow, compare_one
from pdjax.schedules.formulas import formula_conditions
from pdjax.schedules.generators import GENERATORS


def _has_closed_form(name: str) -> bool:
    try:
        formula_conditions(name, F=1.0, B=2.0, W=1.0)
        return True
    except ValueError:
        return False


#: The schedules with a closed-form bubble (:mod:`pdjax.schedules.formulas`): the ones swept.
SCHEDULES = tuple(name for name in GENERATORS if _has_closed_form(name))


@dataclasses.dataclass(frozen=True)
class Sweep:
    schedules: list[str] = knob(list(SCHEDULES), choices=SCHEDULES, nonempty=True)
    num_stages: list[int] = knob([4, 8, 16, 32], minimum=1, nonempty=True)   # P
    microbatch_multipliers: list[int] = knob([1, 2, 4, 8], minimum=1, nonempty=True)  # m = k * P
    num_stages_per_rank: int = knob(2, minimum=1)        # interleaved-1f1b only


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-op times in one unit (e.g. ms); ``FB`` None: no overlapped F&B op."""

    F: float = knob(1.0, minimum=0)
    B: float = knob(2.0, minimum=0)
    W: float = knob(1.0, minimum=0)
    FB: Optional[float] = knob(None, minimum=0)
    comm: float = knob(0.0, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    sweep: Sweep = table(Sweep)
    costs: Costs = table(Costs)

    def __post_init__(self):
        super().__post_init__()
        k = self.costs
        if k.W > k.B:      # B is the full backward: its input-grad part I = B - W must be >= 0
            raise ValueError(f"costs.W: must not exceed costs.B ({k.B:g}), got {k.W:g} (B is the full backward, "
                             "split as I = B - W and W)")
        if not k.F + k.B > 0:   # every bubble ratio divides by a micro-batch's F + B
            raise ValueError(f"costs.F, costs.B: a micro-batch needs some work, F + B > 0; got F = {k.F:g}, "
                             f"B = {k.B:g}")


def stages(c: Config) -> list[int]:
    """The P values of the sweep (``num_stages`` times ``scale``)."""
    return [p * c.scale for p in c.sweep.num_stages]


def grid(c: Config) -> list[tuple[str, int, int]]:
    """The (schedule, P, m) points, in table order (P, then schedule, then m)."""
    return [(name, p, k * p) for p in stages(c) for name in c.sweep.schedules for k in c.sweep.microbatch_multipliers]


def sweep_row(c: Config, point: tuple[str, int, int]) -> ReportRow:
    """One point of :func:`grid`, simulated next to its closed form."""
    name, p, m = point
    costs = {k: v for k, v in dataclasses.asdict(c.costs).items() if v is not None}
    return compare_one(name, p, m, num_stages_per_rank=c.sweep.num_stages_per_rank, **costs)


def summarize(rows, c: Config) -> dict:
    """Row counts, how many rows the closed form matched / did not apply / mismatched, the
    largest |simulated - formula| where it applies, the best schedule per P at the largest m
    and a one-line ``headline``."""
    ran = [r for r in rows if not r.note]
    applies = [r for r in ran if r.formula_applies]
    errors = [abs(r.sim_bubble - r.formula_bubble) for r in applies]
    mismatched = [r for r in applies if not math.isclose(r.sim_bubble, r.formula_bubble, abs_tol=1e-9)]
    best = {}
    k_max = max(c.sweep.microbatch_multipliers)
    for p in stages(c):
        cands = [r for r in ran if r.P == p and r.microbatches == k_max * p]
        if cands:
            b = min(cands, key=lambda r: r.bubble_ratio)
            best[p] = {"schedule": b.schedule, "bubble_ratio": b.bubble_ratio}
    p_mid = sorted(stages(c))[len(stages(c)) // 2]
    parts = [f"{r.schedule} {100 * r.bubble_ratio:.1f}%" for r in ran if r.P == p_mid and r.microbatches == k_max * p_mid]
    not_run = [r for r in rows if r.note]
    headline = (f"bubble ratio at P={p_mid}, m={k_max * p_mid}: " + ", ".join(parts)
                + f"; {len(rows)} rows, {len(ran)} simulated: formulas exact on "
                f"{len(applies) - len(mismatched)}/{len(applies)} rows where they apply, not applicable on "
                f"{len(ran) - len(applies)}; " + _not_run_phrase(not_run))
    return {
        "rows": len(rows),
        "simulated": len(ran),
        "skipped": len(not_run),
        "not_run": [{"schedule": r.schedule, "P": r.P, "microbatches": r.microbatches,
                     "reason": r.note.removeprefix("not applicable: ")} for r in not_run],
        "formula_applies": len(applies),
        "formula_mismatches": len(mismatched),
        "max_abs_error_where_applies": max(errors, default=0.0),
        "best_at_largest_m": best,
        "headline": headline,
    }


def _not_run_phrase(not_run) -> str:
    """How many rows were not run and why: per schedule, its count and its first reason."""
    if not not_run:
        return "every row run"
    by_schedule: dict[str, list] = {}
    for r in not_run:
        by_schedule.setdefault(r.schedule, []).append(r)
    why = "; ".join(f"{name} x{len(rs)}, e.g. P={rs[0].P}, m={rs[0].microbatches}: "
                    f"{rs[0].note.removeprefix('not applicable: ')}" for name, rs in by_schedule.items())
    return f"{len(not_run)} not run ({why})"


def figure(rows, c: Config):
    """Simulated bubble ratio against m, one panel per P (a matplotlib Figure, no pyplot)."""
    from pdjax.schedules.figure import Figure

    ps = stages(c)
    fig = Figure(figsize=(4.2 * len(ps), 3.8))
    axes = fig.subplots(1, len(ps), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], ps):
        for name in c.sweep.schedules:
            pts = [(r.microbatches, r.bubble_ratio) for r in rows if r.P == p and r.schedule == name and not r.note]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=name)
        ms = [k * p for k in c.sweep.microbatch_multipliers]
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", lw=0.8, label="(P-1)/(m+P-1)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"P = {p}")
        ax.set_xlabel("micro-batches m")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated bubble ratio")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    rows = [sweep_row(c, point) for point in progress.track(grid(c), "bubble sweep: schedule x P x m")]
    summary = summarize(rows, c)
    headline = summary.pop("headline")
    body = ("Simulated (ASAP list scheduling of each generated op order) against the closed-form bubble "
            "of every schedule; one row per schedule x P x m in bubble_sweep.csv.")
    return Result("Pipeline bubble sweep", headline, metrics=summary,
                  tables={"bubble_sweep": [r.as_dict() for r in rows]},
                  figures={"bubble_sweep": figure(rows, c)}, body=body)
