"""Searches over deployments: P:D ratio sweep, A:F ratio sweep, and the highest arrival
rate meeting an SLO (DistServe's per-GPU goodput: the largest rate at which at least
``target`` of the requests meet both the TTFT and the TPOT objective).

A search re-generates the workload at each rate from the same spec (same seed): the
lengths are the same draws and the arrival gaps the same draws scaled by 1/rate, so two
rates differ in nothing but the time scale of the arrivals (see :func:`workload_at_rate`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

from pdjax.arguments import check_positive
from pdjax.sim.deployment import AFDisaggregated, PDDisaggregated
from pdjax.sim.simulator import simulate_serving
from pdjax.sim.metrics import SLO
from pdjax.sim.workload import WorkloadSpec, check_rate, sample_requests


def workload_at_rate(spec: WorkloadSpec, rate: float, duration: Optional[float] = None) -> list:
    """The requests of ``spec`` with the arrival rate replaced by ``rate``. Lengths come
    from the same seed; only the gaps scale (gamma gaps scale with 1/rate). With
    ``duration`` (seconds) the request count is ceil(rate * duration), so every rate is
    simulated over the same arrival window (a steady state needs a window much longer
    than a request's lifetime)."""
    changes = {"rate": check_rate(rate)}
    if duration is not None:
        check_positive("duration", duration)
        changes["num_requests"] = max(1, math.ceil(rate * duration))
    return sample_requests(dataclasses.replace(spec, **changes))


def rate_runner(spec: WorkloadSpec, deployment, cost, slo: SLO, duration: Optional[float] = None,
                **sim_kwargs) -> Callable[[float], dict]:
    """A function rate -> simulation summary for ``deployment`` under ``spec`` at that rate
    (over ``duration`` seconds of arrivals when given, see :func:`workload_at_rate`)."""
    if not isinstance(slo, SLO):
        raise TypeError("rate_runner needs an SLO")

    def run(rate: float) -> dict:
        return simulate_serving(deployment, cost, workload_at_rate(spec, rate, duration), slo=slo,
                        **sim_kwargs).summary
    return run


def max_rate_under_slo(run: Callable[[float], dict], *, lo: float, hi: float, target: float = 0.9,
                       rel_tol: float = 0.03, max_iter: int = 24) -> dict:
    """Largest rate in [lo, ...] with ``slo_attainment >= target`` by bisection (attainment
    is assumed non-increasing in the rate). ``hi`` is doubled until it fails (at most 8
    times). Returns ``{"rate", "summary", "trials": [(rate, attainment)], "feasible"}``;
    ``rate`` is 0 and ``feasible`` False when even ``lo`` fails."""
    check_rate(lo)
    check_rate(hi)
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must lie in (0, 1], got {target!r}")
    if hi <= lo:
        raise ValueError(f"need lo < hi, got lo={lo}, hi={hi}")
    trials = []

    def ok(rate):
        s = run(rate)
        trials.append((rate, s["slo_attainment"]))
        return s["slo_attainment"] >= target, s

    good, s_lo = ok(lo)
    if not good:
        return {"rate": 0.0, "summary": s_lo, "trials": trials, "feasible": False}
    best = s_lo
    for _ in range(8):
        good_hi, s_hi = ok(hi)
        if not good_hi:
            break
        lo, best = hi, s_hi
        hi *= 2
    else:
        return {"rate": lo, "summary": best, "trials": trials, "feasible": True}
    for _ in range(max_iter):
        if (hi - lo) <= rel_tol * hi:
            break
        mid = (lo + hi) / 2
        good, s = ok(mid)
        if good:
            lo, best = mid, s
        else:
            hi = mid
    return {"rate": lo, "summary": best, "trials": trials, "feasible": True}


def pd_ratio_sweep(spec: WorkloadSpec, cost, total_instances: int, slo: SLO, *,
                   prefill_counts: Optional[Iterable[int]] = None, search_rate: bool = True,
                   lo: float = 0.5, hi: float = 8.0, target: float = 0.9,
                   pd_kwargs: Optional[dict] = None, duration: Optional[float] = None,
                   **sim_kwargs) -> list[dict]:
    """For each P in ``prefill_counts`` (default 1 .. total-1), deployment P prefill + (total
    - P) decode instances: the summary at ``spec.rate`` and (``search_rate``) the highest
    rate meeting the SLO for ``target`` of the requests. Rows sorted by P."""
    pd_kwargs = dict(pd_kwargs or {})
    if "link_bw" not in pd_kwargs:
        raise ValueError("pd_ratio_sweep needs pd_kwargs['link_bw'] (bytes/s)")
    counts = list(prefill_counts) if prefill_counts is not None else list(range(1, total_instances))
    rows = []
    for p in counts:
        d = total_instances - p
        if p < 1 or d < 1:
            raise ValueError(f"P={p} leaves {d} decode instances out of {total_instances}")
        dep = PDDisaggregated(p, d, **pd_kwargs)
        run = rate_runner(spec, dep, cost, slo, duration, **sim_kwargs)
        s = run(spec.rate)
        row = {"P": p, "D": d, "label": f"{p}P{d}D", **_pick(s)}
        if search_rate:
            best = max_rate_under_slo(run, lo=lo, hi=hi, target=target)
            row["max_rate"] = best["rate"]
            row["max_rate_per_instance"] = best["rate"] / total_instances
        rows.append(row)
    return rows


def af_ratio_sweep(spec: WorkloadSpec, cost, pairs: Iterable[tuple[int, int]], slo: SLO, *,
                   num_prefill: int, microbatches: int = 2, lo: float = 0.5, hi: float = 8.0,
                   target: float = 0.9, af_kwargs: Optional[dict] = None,
                   duration: Optional[float] = None, **sim_kwargs) -> list[dict]:
    """For each (M, N): one AF unit of M attention and N FFN instances behind
    ``num_prefill`` prefill instances; the highest rate meeting the SLO and the sustained
    output tokens/s there (rate x mean output length), per decode-side instance (M + N)."""
    af_kwargs = dict(af_kwargs or {})
    rows = []
    for m_att, n_ffn in pairs:
        dep = AFDisaggregated(num_prefill, 1, num_attention=m_att, num_ffn=n_ffn,
                              microbatches=microbatches, **af_kwargs)
        run = rate_runner(spec, dep, cost, slo, duration, **sim_kwargs)
        best = max_rate_under_slo(run, lo=lo, hi=hi, target=target)
        s = best["summary"]
        rows.append({"M": m_att, "N": n_ffn, "label": f"{m_att}A{n_ffn}F", "max_rate": best["rate"],
                     "decode_instances": m_att + n_ffn,
                     "output_tok_s_per_decode_instance":
                         sustained_output_rate(spec, best["rate"], duration) / (m_att + n_ffn),
                     **_pick(s)})
    return rows


def sustained_output_rate(spec: WorkloadSpec, rate: float, duration: Optional[float] = None) -> float:
    """Output tokens/s offered at ``rate``: rate x the mean output length of the workload
    drawn at that rate (0 at rate 0)."""
    if rate <= 0:
        return 0.0
    reqs = workload_at_rate(spec, rate, duration)
    return rate * sum(r.output_len for r in reqs) / len(reqs)


def _pick(s: dict) -> dict:
    keys = ("offered_rps", "throughput_rps", "goodput_rps", "slo_attainment", "output_tok_s", "ttft_p50", "ttft_p90",
            "tpot_p50", "tpot_p90", "e2e_p90", "util_prefill", "util_decode", "util_colocated",
            "link_utilisation", "prefix_hit_rate", "rejected")
    return {k: s[k] for k in keys if k in s and not (isinstance(s[k], float) and math.isnan(s[k]))}
