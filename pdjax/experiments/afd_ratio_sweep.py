"""Serving simulation: the M:N sweep of one AF-disaggregated unit (M attention + N FFN
instances, ping-pong micro-batches) against plain decode instances of the same count.
Shared tables and ``scale``: :mod:`pdjax.experiments.serving`."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.experiments import progress, serving
from pdjax.experiments.results import Result
from pdjax.experiments.schema import knob, table
from pdjax.sim.deployment import PDDisaggregated
from pdjax.sim.sweeps import af_ratio_sweep, max_rate_under_slo, rate_runner, sustained_output_rate


@dataclasses.dataclass(frozen=True)
class Sweep:
    pairs: list[list[int]] = knob([[6, 2], [5, 3], [4, 4]], nonempty=True)   # (M attention, N FFN)
    prefill: int = knob(4, minimum=1)
    microbatches: int = knob(3, minimum=1)
    max_batch: Optional[int] = knob(None, minimum=1)     # per plain decode instance

    def __post_init__(self):
        for i, pair in enumerate(self.pairs):
            if len(pair) != 2 or min(pair) < 1:
                raise ValueError(f"pairs[{i}]: must be [M, N] with M, N >= 1, got {pair!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(serving.Serving):
    sweep: Sweep = table(Sweep)
    search: serving.Search = table(serving.Search)


def _bounds(cost, max_batch) -> tuple[dict, dict]:
    """(AF-unit options, plain-decode options) for a batch bound per plain decode instance:
    an attention instance holds no expert weights, so its bound scales with its KV room."""
    if max_batch is None:
        return {}, {}
    cap, cap_a = getattr(cost, "kv_capacity", None), getattr(cost, "kv_capacity_attention", None)
    ratio = cap_a / cap if cap and cap_a else 1.0
    return {"max_batch": max(1, int(max_batch * ratio))}, {"max_batch": max_batch}


def _baselines(c: Config, cost, slo, target: float, link: float, sizes, pd_extra: dict) -> dict:
    """decode instances -> (highest SLO rate, output tok/s per instance) of plain decode."""
    base = {}
    for size in progress.track(sizes, "afd_ratio_sweep: plain-decode baselines"):
        run = rate_runner(c.workload, PDDisaggregated(c.sweep.prefill, size, link_bw=link, **pd_extra), cost, slo,
                          c.search.duration)
        b = max_rate_under_slo(run, lo=c.search.lo, hi=c.search.hi, target=target)
        base[size] = (b["rate"], sustained_output_rate(c.workload, b["rate"], c.search.duration) / size)
    return base


def _plot(rows: list[dict], base: dict, m: int, title: str):
    fig = serving.figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = range(len(rows))
    ax.bar(xs, [r["output_tok_s_per_decode_instance"] for r in rows], color="tab:green", label=f"AF unit, m = {m}")
    ax.plot(xs, [base[r["decode_instances"]][1] for r in rows], "k--o", label="plain decode, same instance count")
    ax.set_xticks(xs, [r["label"] for r in rows])
    ax.set_ylabel("sustained output tok/s per decode-side\ninstance at the highest SLO-meeting rate")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    """M:N sweep of one AF unit vs plain decode instances of the same count."""
    from pdjax.analysis import afd_speedup
    from pdjax.analysis.afd_bounds import attention_share
    c, cost, hw, ep, link, _, slo, target = serving.setup(c)
    sw, m = c.sweep, c.sweep.microbatches
    af_extra, pd_extra = _bounds(cost, sw.max_batch)
    rows = []
    for pair in progress.track([tuple(p) for p in sw.pairs], "afd_ratio_sweep: M:N pairs"):
        rows += af_ratio_sweep(c.workload, cost, [pair], slo, num_prefill=sw.prefill, microbatches=m,
                               lo=c.search.lo, hi=c.search.hi, target=target,
                               af_kwargs={"link_bw": link, "exchange_bw": link, **af_extra},
                               duration=c.search.duration)
    base = _baselines(c, cost, slo, target, link, sorted({r["decode_instances"] for r in rows}), pd_extra)
    for r in rows:
        b_rate, b_tok = base[r["decode_instances"]]
        r["baseline_max_rate"] = b_rate
        r["speedup_vs_plain_decode"] = r["output_tok_s_per_decode_instance"] / b_tok if b_tok else math.nan
        r["attention_share"] = attention_share(r["M"], r["N"])
    fig = _plot(rows, base, m, f"AFD M:N sweep, {ep} x {hw.name} per instance")
    best = max(rows, key=lambda r: r["output_tok_s_per_decode_instance"])
    headline = (f"best AF ratio {best['label']} (m = {m}): {best['output_tok_s_per_decode_instance']:.0f} "
                f"output tok/s per decode-side instance, {best['speedup_vs_plain_decode']:.2f}x plain decode "
                f"with the same instance count; M/(M+N) = {best['attention_share']:.2f}")
    notes = ((f"Batch bound: {pd_extra['max_batch']} requests per plain decode instance, "
              f"{af_extra['max_batch']} per attention instance (scaled by the KV room left without "
              "expert weights: the B_AFD / B_base factor). ") if pd_extra else "") + (
             "The speedup model of pdjax.analysis.afd_speedup is (B_AFD/B_base) * (T_base/T_AFD) * M/(M+N); "
             f"e.g. afd_speedup(1.5, 1.15, 0.85) = {afd_speedup(1.5, 1.15, 0.85):.3f}.")
    return serving.result("AF-disaggregation M:N sweep", "afd_ratio_sweep", headline, rows, fig, notes,
                          best=best["label"])
