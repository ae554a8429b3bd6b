"""Serving simulation: the disaggregation gain (PD's highest SLO rate over colocated's)
against the KV link bandwidth, next to the analytic handoff ratio
t_comm / t_comp = KV_per_token * R_peak / (2 N_a BW) (1.9 % at 50 GB/s). Shared tables and
``scale``: :mod:`pdjax.experiments.serving`."""

from __future__ import annotations

import dataclasses
import math

from pdjax.experiments import progress, serving
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, table
from pdjax.sim.deployment import Colocated, PDDisaggregated
from pdjax.sim.sweeps import max_rate_under_slo, rate_runner


@dataclasses.dataclass(frozen=True)
class Sweep:
    instances: int = knob(8, minimum=2)
    prefill: int = knob(4, minimum=1)
    colocated_token_budget: int = knob(2048, minimum=1)
    link_gbps_per_gpu: list[float] = knob([0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0], above=0, nonempty=True)

    def __post_init__(self):
        serving.check_split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(serving.Serving):
    sweep: Sweep = table(Sweep)
    search: serving.Search = table(serving.Search)


def _plot(rows: list[dict], title: str):
    fig = serving.figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = [r["link_gbps_per_gpu"] for r in rows]
    ax.plot(xs, [r["gain"] for r in rows], "o-", label="PD / colocated highest SLO rate")
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("KV link bandwidth per GPU (GB/s)")
    ax.set_ylabel("disaggregation gain")
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * r["handoff_ratio"] for r in rows], "s:", color="tab:red", label="t_comm/t_comp (%)")
    ax2.set_yscale("log")
    ax2.set_ylabel("handoff / prefill compute (%)", color="tab:red")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _headline(rows: list[dict]) -> str:
    hi_r, lo_r = max(rows, key=lambda r: r["link_gbps_per_gpu"]), min(rows, key=lambda r: r["link_gbps_per_gpu"])
    at50 = [r for r in rows if r["link_gbps_per_gpu"] == 50.0]
    ref = at50[0] if at50 else hi_r
    keep = [r for r in rows if r["gain"] >= 0.95 * ref["gain"]]
    knee = min(keep, key=lambda r: r["link_gbps_per_gpu"]) if keep else ref
    return (f"at {ref['link_gbps_per_gpu']:g} GB/s the handoff is {ref['handoff_ratio']:.1%} of prefill compute "
            f"and PD sustains {ref['gain']:.2f}x the colocated rate; the gain holds down to "
            f"{knee['link_gbps_per_gpu']:g} GB/s (handoff {knee['handoff_ratio']:.0%} of prefill compute, "
            f"the link still keeps up) and falls to {lo_r['gain']:.2f}x at {lo_r['link_gbps_per_gpu']:g} GB/s "
            f"(handoff {lo_r['handoff_ratio']:.0%}, link utilisation {lo_r['link_utilisation']:.0%})")


def run(c: Config, out_dir: str) -> Result:
    """Disaggregation gain against KV link bandwidth, next to the analytic handoff ratio."""
    from pdjax.analysis import handoff_to_prefill_ratio, kv_bytes_per_token, param_counts
    c, cost, hw, ep, _, model, slo, target = serving.setup(c)
    sw = c.sweep
    n, p = sw.instances, sw.prefill
    kvb = kv_bytes_per_token(model, dtype_bytes=1 if c.hardware.dtype == "fp8" else 2)
    n_a = param_counts(model).active
    with progress.counter("link_bandwidth: colocated highest-rate search (simulations)") as advance:
        colo = serving.search_rate(rate_runner(c.workload, Colocated(n, token_budget=sw.colocated_token_budget),
                                               cost, slo, c.search.duration), c, target, advance)["rate"]
    rows = []
    for gbps in progress.track(sw.link_gbps_per_gpu, "link_bandwidth: link speeds"):
        run = rate_runner(c.workload, PDDisaggregated(p, n - p, link_bw=ep * gbps * 1e9), cost, slo, c.search.duration)
        best = max_rate_under_slo(run, lo=c.search.lo, hi=c.search.hi, target=target)
        s = best["summary"]
        rows.append({"link_gbps_per_gpu": gbps,
                     "handoff_ratio": handoff_to_prefill_ratio(kvb, n_a, hw.peak_flops(c.hardware.dtype), gbps * 1e9),
                     "pd_max_rate": best["rate"], "colocated_max_rate": colo,
                     "gain": best["rate"] / colo if colo else math.nan,
                     "kv_wait_p90": s.get("kv_wait_p90", math.nan), "link_utilisation": s["link_utilisation"]})
    fig = _plot(rows, f"{p}P{n - p}D vs {n} colocated, {ep} x {hw.name}")
    return serving.result("KV link bandwidth vs disaggregation gain", "link_bandwidth", _headline(rows), rows, fig,
                          colocated_max_rate=colo)
