"""Serving metrics from the simulator's request records.

Per finished request (seconds):

* TTFT = first token time - arrival (prefill queueing + handshake wait + prefill; the
  prefill instance returns the first token, so the KV transfer is not in it);
* TPOT = (finish - first token) / (output_len - 1), the mean time per output token after
  the first (includes the exposed KV transfer and decode queueing; undefined for
  single-token outputs, which meet any TPOT SLO);
* E2E = finish - arrival.

ITL (inter-token latency) is per token: each decode step contributes its duration for
every request that was already in the batch, and a joining request contributes the gap
from its first token. Percentiles are P50/P90/P99 (numpy "linear"; ITL weighted).

Throughput is over the span from the first arrival to the last finish: finished requests/s,
input and output tokens/s. The offered rate is requests per second of the arrival window
(first to last arrival). Goodput = SLO attainment x offered rate, i.e. requests meeting
both SLOs per second of the arrival window (so a drain tail does not dilute it);
SLO attainment = meeting requests / all requests (a rejected request misses).
Utilisation of a pool = busy step time / instance-alive time. Link utilisation = transfer
busy time / (span * prefill instances).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

PCTS = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds: TTFT and TPOT (both must be > 0)."""

    ttft: float
    tpot: float

    def __post_init__(self):
        for name in ("ttft", "tpot"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SLO {name} must be a finite time > 0 seconds (an SLO <= 0 "
                                 f"cannot be met), got {v!r}")


def percentiles(x, weights=None, pcts=PCTS) -> dict:
    """``{"p50": ..., ...}`` of ``x`` (NaN if empty); optional integer-like weights."""
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return {f"p{p}": math.nan for p in pcts}
    if weights is None:
        v = np.percentile(x, pcts)
    else:
        w = np.asarray(weights, dtype=float)
        keep = w > 0
        x, w = x[keep], w[keep]
        if x.size == 0:
            return {f"p{p}": math.nan for p in pcts}
        order = np.argsort(x, kind="stable")
        x, w = x[order], w[order]
        cum = np.cumsum(w)
        v = [x[min(np.searchsorted(cum, p / 100 * cum[-1], side="left"), x.size - 1)] for p in pcts]
    return {f"p{p}": float(a) for p, a in zip(pcts, v)}


def request_table(requests) -> dict:
    """Columns (numpy arrays) of per-request latencies; NaN where undefined."""
    fin = [r for r in requests if r.status == "finished"]
    arr = np.array([r.arrival for r in fin])
    first = np.array([r.t_first for r in fin])
    end = np.array([r.t_finish for r in fin])
    out = np.array([r.output_len for r in fin], dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), np.nan)
    return {"ttft": first - arr, "tpot": tpot, "e2e": end - arr, "output_len": out,
            "input_len": np.array([r.input_len for r in fin], dtype=float),
            "cached": np.array([r.cached for r in fin], dtype=float),
            "kv_wait": np.array([r.kv_wait for r in fin], dtype=float),
            "handshake_wait": np.array([r.t_handshake - r.arrival for r in fin], dtype=float)}


def slo_mask(table: dict, slo: SLO) -> np.ndarray:
    """Finished requests meeting both SLOs (single-token outputs: TTFT only)."""
    tpot_ok = np.where(np.isnan(table["tpot"]), True, table["tpot"] <= slo.tpot * (1 + 1e-12))
    return (table["ttft"] <= slo.ttft * (1 + 1e-12)) & tpot_ok


def summarize(requests, slo: Optional[SLO] = None, *, pools: dict | None = None,
              itl=None, transfer_bytes: float = 0.0, link_busy: float = 0.0,
              num_links: int = 0, extra: dict | None = None) -> dict:
    """The summary dict of one simulation (see the module docstring)."""
    n = len(requests)
    fin = sum(1 for r in requests if r.status == "finished")
    rej = [r for r in requests if r.status == "rejected"]
    reasons: dict = {}
    for r in rej:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    assert fin + len(rej) == n, f"lost requests: {n} total, {fin} finished, {len(rej)} rejected"
    tab = request_table(requests)
    t0 = min((r.arrival for r in requests), default=0.0)
    t1 = max((r.t_finish for r in requests if r.status == "finished"), default=t0)
    span = max(t1 - t0, 1e-12)
    last_arrival = max((r.arrival for r in requests), default=t0)
    window = last_arrival - t0 if last_arrival > t0 else span
    s = {"requests": n, "finished": fin, "rejected": len(rej), "reject_reasons": reasons,
         "span_s": span, "offered_rps": n / window, "throughput_rps": fin / span,
         "input_tok_s": float(tab["input_len"].sum()) / span,
         "output_tok_s": float(tab["output_len"].sum()) / span,
         "prefix_hit_rate": (float(tab["cached"].sum() / tab["input_len"].sum())
                             if fin and tab["input_len"].sum() else 0.0),
         "transfer_bytes": float(transfer_bytes),
         "link_utilisation": link_busy / (span * num_links) if num_links else 0.0}
    for key in ("ttft", "tpot", "e2e", "kv_wait", "handshake_wait"):
        vals = tab[key][~np.isnan(tab[key])]
        s[f"{key}_mean"] = float(vals.mean()) if vals.size else math.nan
        for p, v in percentiles(vals).items():
            s[f"{key}_{p}"] = v
    if itl is not None and len(itl[0]):
        for p, v in percentiles(itl[0], itl[1]).items():
            s[f"itl_{p}"] = v
    if slo is not None:
        ok = int(slo_mask(tab, slo).sum()) if fin else 0
        s.update(slo_ttft=slo.ttft, slo_tpot=slo.tpot, slo_met=ok,
                 slo_attainment=ok / n if n else 0.0, goodput_rps=ok / window)
    for pool, (busy, alive, count) in (pools or {}).items():
        s[f"util_{pool}"] = busy / alive if alive else 0.0
        s[f"instances_{pool}"] = count
    if extra:
        s.update(extra)
    return s
