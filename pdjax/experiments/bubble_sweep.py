"""Experiment: every pipeline schedule x P x m, simulated bubble vs its closed form
(:mod:`pdjax.schedules.sweep` does the work; this module types the config and reports).
``scale`` multiplies every ``num_stages`` (m follows as multiplier x P)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.experiments import progress
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, parse, table
from pdjax.schedules import sweep
from pdjax.schedules.generators import GENERATORS


@dataclasses.dataclass(frozen=True)
class Sweep:
    schedules: list[str] = knob(list(GENERATORS), choices=GENERATORS, nonempty=True)
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


@dataclasses.dataclass(frozen=True)
class Config:
    sweep: Sweep = table(Sweep)
    costs: Costs = table(Costs)


def run_bubble_sweep(cfg: dict, out_dir: str) -> Result:
    c = parse(Config, {k: cfg[k] for k in ("sweep", "costs") if k in cfg})
    scale = cfg.get("scale", 1)
    stages = [p * scale for p in c.sweep.num_stages]
    settings = sweep.parse_config({
        "sweep": {"schedules": c.sweep.schedules, "num_stages": stages,
                  "microbatch_multipliers": c.sweep.microbatch_multipliers,
                  "num_stages_per_rank": c.sweep.num_stages_per_rank},
        "costs": {k: v for k, v in dataclasses.asdict(c.costs).items() if v is not None}})
    rows = [sweep.sweep_row(settings, point)
            for point in progress.track(sweep.grid(settings), "bubble sweep: schedule x P x m")]
    summary = sweep.summarize(rows, settings)
    headline = summary.pop("headline")
    body = ("Simulated (ASAP list scheduling of each generated op order) against the closed-form bubble "
            "of every schedule; one row per schedule x P x m in bubble_sweep.csv.")
    return Result("Pipeline bubble sweep", headline, metrics=summary,
                  tables={"bubble_sweep": [r.as_dict() for r in rows]},
                  figures={"bubble_sweep": sweep.figure(rows, settings)}, body=body)
