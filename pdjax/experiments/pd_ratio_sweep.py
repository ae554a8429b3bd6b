"""Serving simulation: a Mooncake-style P:D sweep at a fixed instance count, the highest
rate each split sustains at the SLO target. Shared tables and ``scale``:
:mod:`pdjax.experiments.serving`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.experiments import progress, serving
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, table
from pdjax.sim.sweeps import pd_ratio_sweep


@dataclasses.dataclass(frozen=True)
class Sweep:
    instances: int = knob(16, minimum=2)
    prefill: Optional[list[int]] = knob(None, minimum=1)   # P values; none: total/2 - 3 ... total/2 + 3

    def __post_init__(self):
        for p in self.prefill or ():
            serving.check_split(self.instances, p)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(serving.Serving):
    sweep: Sweep = table(Sweep)
    search: serving.Search = table(serving.Search)
    pd: dict = knob({})


def best_split(rows: list[dict]) -> dict:
    """The P:D decision of a sweep's rows (:func:`pdjax.sim.sweeps.pd_ratio_sweep`): the split
    with the highest rate meeting the SLO, the fewer prefill instances on a tie."""
    return max(rows, key=lambda r: (r["max_rate"], -r["P"]))


def run(c: Config, out_dir: str) -> Result:
    """Mooncake-style P:D sweep at a fixed instance count: highest rate meeting the SLO."""
    c, cost, hw, ep, link, _, slo, target = serving.setup(c)
    total = c.sweep.instances
    counts = c.sweep.prefill or list(range(max(1, total // 2 - 3), min(total, total // 2 + 4)))
    rows = []
    for p in progress.track(counts, "pd_ratio_sweep: P:D splits"):
        rows += pd_ratio_sweep(c.workload, cost, total, slo, prefill_counts=[p], lo=c.search.lo, hi=c.search.hi,
                               target=target, pd_kwargs=serving.pd_kwargs(c, link), duration=c.search.duration)
    fig = serving.figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.bar(range(len(rows)), [r["max_rate"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows])
    ax.set_ylabel(f"highest rate at {target:.0%} SLO attainment (req/s)")
    ax.set_title(f"P:D sweep, {total} instances of {ep} x {hw.name}")
    fig.tight_layout()
    best = best_split(rows)
    headline = (f"best P:D on {total} instances: {best['label']} sustains {best['max_rate']:.2f} req/s "
                f"at {target:.0%} SLO attainment (range {min(r['max_rate'] for r in rows):.2f}-"
                f"{best['max_rate']:.2f} over {rows[0]['label']}..{rows[-1]['label']})")
    return serving.result("P:D ratio sweep", "pd_ratio_sweep", headline, rows, fig, best=best["label"])
