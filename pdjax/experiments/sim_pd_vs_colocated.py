"""Serving simulation: goodput over arrival rate, N colocated instances against the same N
split into P prefill + D decode instances, and the highest rate each sustains at the SLO
target. Shared tables and ``scale``: :mod:`pdjax.experiments.serving`."""

from __future__ import annotations

import dataclasses
import math

from pdjax.experiments import progress, serving
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, table
from pdjax.sim.deployment import Colocated, PDDisaggregated
from pdjax.sim.simulator import simulate_serving
from pdjax.sim.sweeps import _pick, rate_runner, workload_at_rate


@dataclasses.dataclass(frozen=True)
class SplitKnobs:
    instances: int = knob(8, minimum=2)
    prefill: int = knob(4, minimum=1)
    colocated_token_budget: int = knob(2048, minimum=1)    # Sarathi-style tokens per colocated step

    def __post_init__(self):
        serving.check_split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True)
class RateSweep:
    rates: list[float] = knob([1.0, 2.0, 4.0, 8.0], above=0, nonempty=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(serving.Serving):
    deployment: SplitKnobs = table(SplitKnobs)
    sweep: RateSweep = table(RateSweep)
    search: serving.Search = table(serving.Search)
    pd: dict = knob({})


def _plot(rows: list[dict], labels, target: float, title: str):
    fig = serving.figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for label in labels:
        pts = [r for r in rows if r["deployment"] == label]
        axes[0].plot([r["rate"] for r in pts], [r["goodput_rps"] for r in pts], marker="o", label=label)
        axes[1].plot([r["rate"] for r in pts], [r["slo_attainment"] for r in pts], marker="o", label=label)
    axes[0].set_ylabel("goodput (SLO-meeting req/s)")
    axes[1].set_ylabel("SLO attainment")
    axes[1].axhline(target, color="grey", ls="--", lw=1)
    for ax in axes:
        ax.set_xlabel("arrival rate (req/s)")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    """Goodput over arrival rate: N colocated instances vs the same N split P + D."""
    c, cost, hw, ep, link, _, slo, target = serving.setup(c)
    n, p = c.deployment.instances, c.deployment.prefill
    deployments = {"colocated": Colocated(n, token_budget=c.deployment.colocated_token_budget),
                   f"{p}P{n - p}D": PDDisaggregated(p, n - p, **serving.pd_kwargs(c, link))}
    rows = []
    for rate in progress.track(c.sweep.rates, "sim_pd_vs_colocated: rates"):
        reqs = workload_at_rate(c.workload, rate, c.search.duration)
        for label, dep in deployments.items():
            s = simulate_serving(dep, cost, reqs, slo=slo).summary
            rows.append({"rate": rate, "deployment": label, **_pick(s)})
    with progress.counter("sim_pd_vs_colocated: highest-rate search (simulations)") as advance:
        best = {label: serving.search_rate(rate_runner(c.workload, dep, cost, slo, c.search.duration), c, target,
                                           advance)["rate"]
                for label, dep in deployments.items()}
    fig = _plot(rows, best, target, f"{n} instances of {ep} x {hw.name}: colocated vs PD "
                                    f"(TTFT {slo.ttft:g} s, TPOT {slo.tpot * 1e3:g} ms)")
    (lc, rc), (lp, rp) = best.items()
    headline = (f"highest rate with {target:.0%} SLO attainment on {n} instances: {lc} {rc:.2f} req/s, "
                f"{lp} {rp:.2f} req/s ({(rp / rc - 1) * 100 if rc else math.inf:+.0f} % for PD)")
    return serving.result("Colocated vs PD-disaggregated goodput", "sim_pd_vs_colocated", headline, rows, fig,
                          max_rate=best)
