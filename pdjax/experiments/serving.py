"""Serving-simulator experiments (:mod:`pdjax.sim`): typed configs and runners
``run_<kind>(config, out_dir) -> Result``.

Shared tables: ``[model]`` ``preset``; ``[hardware]`` ``name`` (a preset), ``dtype``
("bf16"/"fp8"), ``ep_size`` (accelerators per instance), ``cost`` ("linear" =
LinearStepCost.from_roofline, "roofline" = pdjax.analysis.costmodel.RooflineCostModel),
``mfu`` / ``mbu`` (linear cost only), ``link_gbps_per_gpu`` (KV link, decimal GB/s per
accelerator; default the preset's scale-out bandwidth); ``[workload]`` the fields of
:class:`pdjax.sim.WorkloadSpec`; ``[slo]`` ``ttft``, ``tpot`` (seconds), ``target``
(attainment the rate search keeps); ``[search]`` ``lo``, ``hi`` (req/s), ``duration``
(seconds of arrivals simulated at each rate; none: ``num_requests`` at every rate);
``[pd]`` extra :class:`pdjax.sim.PDDisaggregated` fields (e.g. ``token_budget``).

``scale`` multiplies the simulated traffic (``num_requests`` and ``duration``): the rates,
deployments and SLOs stay, the statistics tighten. The simulation is deterministic: the
same config and ``workload.seed`` give the same metrics.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pdjax.configs import PRESETS
from pdjax.experiments import progress
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import knob, parse, table
from pdjax.sim.cost import LinearStepCost
from pdjax.sim.deployment import Colocated, PDDisaggregated
from pdjax.sim import simulate
from pdjax.sim.metrics import SLO
from pdjax.sim.prefix_cache import PrefixCache
from pdjax.sim.search import (_pick, af_ratio_sweep, max_rate_under_slo, pd_ratio_sweep,
                              rate_runner, sustained_output_rate, workload_at_rate)
from pdjax.sim.workload import WorkloadSpec, check_rate, length_dist

SIMULATOR_NOTE = "Model: discrete-event serving simulation (pdjax.sim; docs/sim.md)."


# ---- config tables --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
    preset: str = knob("deepseek_v3", choices=PRESETS)


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str = "h800"
    dtype: str = knob("bf16", choices=("bf16", "fp8"))
    ep_size: int = knob(1, minimum=1)
    cost: str = knob("linear", choices=("linear", "roofline"))
    mfu: float = knob(1.0, above=0)
    mbu: float = knob(1.0, above=0)
    link_gbps_per_gpu: Optional[float] = knob(None, above=0)

    def __post_init__(self):
        from pdjax.analysis import hardware
        try:
            hardware(self.name)
        except ValueError as e:
            raise ValueError(f"name: {e}") from None


@dataclasses.dataclass(frozen=True)
class Slo:
    ttft: float
    tpot: float
    target: float = knob(0.9, above=0)

    def __post_init__(self):
        for name in ("ttft", "tpot"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}: must be a finite time > 0 seconds, got {getattr(self, name)!r}")
        if self.target > 1:
            raise ValueError(f"target: must lie in (0, 1], got {self.target!r}")


@dataclasses.dataclass(frozen=True)
class Search:
    lo: float = knob(0.25, above=0)
    hi: float = knob(8.0, above=0)
    duration: Optional[float] = knob(None, above=0)

    def __post_init__(self):
        if self.hi <= self.lo:
            raise ValueError(f"hi: must exceed lo = {self.lo}, got {self.hi}")


@dataclasses.dataclass(frozen=True)
class Serving:
    """The tables every serving experiment shares."""

    workload: WorkloadSpec
    slo: Slo
    model: Model = table(Model)
    hardware: Hardware = table(Hardware)

    def __post_init__(self):
        lengths = ("input", "output", "turns") + (("system_prompt_len",) if self.workload.system_prompts else ())
        for name in lengths:
            try:
                length_dist(getattr(self.workload, name))
            except ValueError as e:
                raise ValueError(f"workload.{name}: {e}") from None
        try:
            check_rate(self.workload.rate)
        except ValueError as e:
            raise ValueError(f"workload.rate: {e}") from None
        pd = getattr(self, "pd", None)
        if pd is not None:
            known = [f.name for f in dataclasses.fields(PDDisaggregated) if f.name not in ("num_prefill", "num_decode")]
            for key in pd:
                if key not in known:
                    raise ValueError(f"pd.{key}: unknown key (known: {', '.join(known)})")
            try:
                PDDisaggregated(1, 1, **{"link_bw": 1.0, **pd})
            except (TypeError, ValueError) as e:
                raise ValueError(f"pd: {e}") from None


def _split(instances: int, prefill: int) -> None:
    if not 1 <= prefill < instances:
        raise ValueError(f"prefill: must leave at least one decode instance: 1 <= prefill < instances = "
                         f"{instances}, got {prefill}")


@dataclasses.dataclass(frozen=True)
class Deployment:
    instances: int = knob(8, minimum=2)
    prefill: int = knob(4, minimum=1)
    colocated_token_budget: int = knob(2048, minimum=1)    # Sarathi-style tokens per colocated step

    def __post_init__(self):
        _split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True)
class RateSweep:
    rates: list[float] = knob([1.0, 2.0, 4.0, 8.0], above=0, nonempty=True)


@dataclasses.dataclass(frozen=True)
class ColocatedVsPDConfig(Serving):
    deployment: Deployment = table(Deployment)
    sweep: RateSweep = table(RateSweep)
    search: Search = table(Search)
    pd: dict = knob({})


@dataclasses.dataclass(frozen=True)
class PDRatioSweep:
    instances: int = knob(16, minimum=2)
    prefill: Optional[list[int]] = knob(None, minimum=1)   # P values; none: total/2 - 3 ... total/2 + 3

    def __post_init__(self):
        for p in self.prefill or ():
            _split(self.instances, p)


@dataclasses.dataclass(frozen=True)
class PDRatioSweepConfig(Serving):
    sweep: PDRatioSweep = table(PDRatioSweep)
    search: Search = table(Search)
    pd: dict = knob({})


@dataclasses.dataclass(frozen=True)
class AFDRatioSweep:
    pairs: list[list[int]] = knob([[6, 2], [5, 3], [4, 4]], nonempty=True)   # (M attention, N FFN)
    prefill: int = knob(4, minimum=1)
    microbatches: int = knob(3, minimum=1)
    max_batch: Optional[int] = knob(None, minimum=1)     # per plain decode instance

    def __post_init__(self):
        for i, pair in enumerate(self.pairs):
            if len(pair) != 2 or min(pair) < 1:
                raise ValueError(f"pairs[{i}]: must be [M, N] with M, N >= 1, got {pair!r}")


@dataclasses.dataclass(frozen=True)
class AFDRatioSweepConfig(Serving):
    sweep: AFDRatioSweep = table(AFDRatioSweep)
    search: Search = table(Search)


@dataclasses.dataclass(frozen=True)
class LinkSweep:
    instances: int = knob(8, minimum=2)
    prefill: int = knob(4, minimum=1)
    colocated_token_budget: int = knob(2048, minimum=1)
    link_gbps_per_gpu: list[float] = knob([0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0], above=0, nonempty=True)

    def __post_init__(self):
        _split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True)
class LinkBandwidthConfig(Serving):
    sweep: LinkSweep = table(LinkSweep)
    search: Search = table(Search)


@dataclasses.dataclass(frozen=True)
class PrefixSweep:
    instances: int = knob(4, minimum=2)
    prefill: int = knob(2, minimum=1)
    block_size: int = knob(64, minimum=1)
    capacity_tokens: list[int] = knob([0, 16384, 65536, 262144, 1048576, 4194304], minimum=0, nonempty=True)
    retention: Optional[dict[str, float]] = None        # seconds a traffic class's blocks stay

    def __post_init__(self):
        _split(self.instances, self.prefill)


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig(Serving):
    sweep: PrefixSweep = table(PrefixSweep)
    pd: dict = knob({})


# ---- shared parts ---------------------------------------------------------------------
def _parse(cls, cfg: dict):
    """The typed config, its workload and search duration multiplied by ``scale``."""
    c = parse(cls, {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name in cfg})
    scale = cfg.get("scale", 1)
    if scale != 1:
        c = dataclasses.replace(c, workload=dataclasses.replace(c.workload,
                                                                num_requests=c.workload.num_requests * scale))
        search = getattr(c, "search", None)
        if search is not None and search.duration is not None:
            c = dataclasses.replace(c, search=dataclasses.replace(search, duration=search.duration * scale))
    return c


def build_cost(c: Serving):
    """(cost model, hardware spec, ep_size, per-instance link bytes/s, model config)."""
    import pdjax
    from pdjax.analysis import hardware
    model = pdjax.configs.preset(c.model.preset)
    h = c.hardware
    hw = hardware(h.name)
    if h.cost == "linear":
        cost = LinearStepCost.from_roofline(model, hw, dtype=h.dtype, ep_size=h.ep_size, mfu=h.mfu, mbu=h.mbu)
    else:
        from pdjax.analysis.costmodel import RooflineCostModel
        cost = RooflineCostModel(model, hw, dtype_bytes=1 if h.dtype == "fp8" else 2, ep_size=h.ep_size)
    gbps = h.link_gbps_per_gpu
    link = h.ep_size * (gbps * 1e9 if gbps is not None else hw.link_bw("scale_out"))
    return cost, hw, h.ep_size, link, model


def _slo(c: Serving) -> tuple[SLO, float]:
    return SLO(c.slo.ttft, c.slo.tpot), c.slo.target


def _pd_kwargs(c, link: float) -> dict:
    return {"link_bw": link, **c.pd}


def _figure(**kwargs):
    """A matplotlib Figure, drawn without pyplot (no global backend or figure state)."""
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def _result(title: str, name: str, headline: str, rows: list[dict], fig, notes: str = "", **metrics) -> Result:
    body = "\n\n".join(x for x in (notes, markdown_table(rows), SIMULATOR_NOTE) if x)
    return Result(title, headline, metrics={**metrics, "rows": rows}, tables={name: rows}, figures={name: fig},
                  body=body)


def _search(run, c, target: float, advance) -> dict:
    return max_rate_under_slo(progress.counted(run, advance), lo=c.search.lo, hi=c.search.hi, target=target)


# ---- experiments ----------------------------------------------------------------------
def run_colocated_vs_pd(cfg: dict, out_dir: str) -> Result:
    """Goodput over arrival rate: N colocated instances vs the same N split P + D."""
    c = _parse(ColocatedVsPDConfig, cfg)
    cost, hw, ep, link, _ = build_cost(c)
    slo, target = _slo(c)
    n, p = c.deployment.instances, c.deployment.prefill
    deployments = {"colocated": Colocated(n, token_budget=c.deployment.colocated_token_budget),
                   f"{p}P{n - p}D": PDDisaggregated(p, n - p, **_pd_kwargs(c, link))}
    rows = []
    for rate in progress.track(c.sweep.rates, "colocated_vs_pd: rates"):
        reqs = workload_at_rate(c.workload, rate, c.search.duration)
        for label, dep in deployments.items():
            s = simulate(dep, cost, reqs, slo=slo).summary
            rows.append({"rate": rate, "deployment": label, **_pick(s)})
    with progress.counter("colocated_vs_pd: highest-rate search (simulations)") as advance:
        best = {label: _search(rate_runner(c.workload, dep, cost, slo, c.search.duration), c, target, advance)["rate"]
                for label, dep in deployments.items()}
    fig = _figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for label in best:
        pts = [r for r in rows if r["deployment"] == label]
        axes[0].plot([r["rate"] for r in pts], [r["goodput_rps"] for r in pts], marker="o", label=label)
        axes[1].plot([r["rate"] for r in pts], [r["slo_attainment"] for r in pts], marker="o", label=label)
    axes[0].set_ylabel("goodput (SLO-meeting req/s)")
    axes[1].set_ylabel("SLO attainment")
    axes[1].axhline(target, color="grey", ls="--", lw=1)
    for ax in axes:
        ax.set_xlabel("arrival rate (req/s)")
        ax.legend()
    fig.suptitle(f"{n} instances of {ep} x {hw.name}: colocated vs PD "
                 f"(TTFT {slo.ttft:g} s, TPOT {slo.tpot * 1e3:g} ms)")
    fig.tight_layout()
    (lc, rc), (lp, rp) = best.items()
    headline = (f"highest rate with {target:.0%} SLO attainment on {n} instances: {lc} {rc:.2f} req/s, "
                f"{lp} {rp:.2f} req/s ({(rp / rc - 1) * 100 if rc else math.inf:+.0f} % for PD)")
    return _result("Colocated vs PD-disaggregated goodput", "colocated_vs_pd", headline, rows, fig, max_rate=best)


def run_pd_ratio_sweep(cfg: dict, out_dir: str) -> Result:
    """Mooncake-style P:D sweep at a fixed instance count: highest rate meeting the SLO."""
    c = _parse(PDRatioSweepConfig, cfg)
    cost, hw, ep, link, _ = build_cost(c)
    slo, target = _slo(c)
    total = c.sweep.instances
    counts = c.sweep.prefill or list(range(max(1, total // 2 - 3), min(total, total // 2 + 4)))
    rows = []
    for p in progress.track(counts, "pd_ratio_sweep: P:D splits"):
        rows += pd_ratio_sweep(c.workload, cost, total, slo, prefill_counts=[p], lo=c.search.lo, hi=c.search.hi,
                               target=target, pd_kwargs=_pd_kwargs(c, link), duration=c.search.duration)
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.bar(range(len(rows)), [r["max_rate"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows])
    ax.set_ylabel(f"highest rate at {target:.0%} SLO attainment (req/s)")
    ax.set_title(f"P:D sweep, {total} instances of {ep} x {hw.name}")
    fig.tight_layout()
    best = max(rows, key=lambda r: (r["max_rate"], -r["P"]))
    headline = (f"best P:D on {total} instances: {best['label']} sustains {best['max_rate']:.2f} req/s "
                f"at {target:.0%} SLO attainment (range {min(r['max_rate'] for r in rows):.2f}-"
                f"{best['max_rate']:.2f} over {rows[0]['label']}..{rows[-1]['label']})")
    return _result("P:D ratio sweep", "pd_ratio_sweep", headline, rows, fig, best=best["label"])


def run_afd_ratio_sweep(cfg: dict, out_dir: str) -> Result:
    """M:N sweep of one AF unit vs plain decode instances of the same count."""
    from pdjax.analysis import afd_speedup, attention_share
    c = _parse(AFDRatioSweepConfig, cfg)
    cost, hw, ep, link, _ = build_cost(c)
    slo, target = _slo(c)
    sw, m = c.sweep, c.sweep.microbatches
    af_kwargs = {"link_bw": link, "exchange_bw": link}
    pd_extra = {}
    if sw.max_batch is not None:
        # an attention instance holds no expert weights: its batch bound scales with its KV room
        cap, cap_a = getattr(cost, "kv_capacity", None), getattr(cost, "kv_capacity_attention", None)
        ratio = cap_a / cap if cap and cap_a else 1.0
        af_kwargs["max_batch"] = max(1, int(sw.max_batch * ratio))
        pd_extra["max_batch"] = sw.max_batch
    rows = []
    for pair in progress.track([tuple(p) for p in sw.pairs], "afd_ratio_sweep: M:N pairs"):
        rows += af_ratio_sweep(c.workload, cost, [pair], slo, num_prefill=sw.prefill, microbatches=m,
                               lo=c.search.lo, hi=c.search.hi, target=target, af_kwargs=af_kwargs,
                               duration=c.search.duration)
    base = {}
    sizes = sorted({r["decode_instances"] for r in rows})
    for size in progress.track(sizes, "afd_ratio_sweep: plain-decode baselines"):
        run = rate_runner(c.workload, PDDisaggregated(sw.prefill, size, link_bw=link, **pd_extra), cost, slo,
                          c.search.duration)
        b = max_rate_under_slo(run, lo=c.search.lo, hi=c.search.hi, target=target)
        base[size] = (b["rate"], sustained_output_rate(c.workload, b["rate"], c.search.duration) / size)
    for r in rows:
        b_rate, b_tok = base[r["decode_instances"]]
        r["baseline_max_rate"] = b_rate
        r["speedup_vs_plain_decode"] = r["output_tok_s_per_decode_instance"] / b_tok if b_tok else math.nan
        r["attention_share"] = attention_share(r["M"], r["N"])
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = range(len(rows))
    ax.bar(xs, [r["output_tok_s_per_decode_instance"] for r in rows], color="tab:green", label=f"AF unit, m = {m}")
    ax.plot(xs, [base[r["decode_instances"]][1] for r in rows], "k--o", label="plain decode, same instance count")
    ax.set_xticks(xs, [r["label"] for r in rows])
    ax.set_ylabel("sustained output tok/s per decode-side\ninstance at the highest SLO-meeting rate")
    ax.set_title(f"AFD M:N sweep, {ep} x {hw.name} per instance")
    ax.legend()
    fig.tight_layout()
    best = max(rows, key=lambda r: r["output_tok_s_per_decode_instance"])
    headline = (f"best AF ratio {best['label']} (m = {m}): {best['output_tok_s_per_decode_instance']:.0f} "
                f"output tok/s per decode-side instance, {best['speedup_vs_plain_decode']:.2f}x plain decode "
                f"with the same instance count; M/(M+N) = {best['attention_share']:.2f}")
    notes = ((f"Batch bound: {pd_extra['max_batch']} requests per plain decode instance, "
              f"{af_kwargs['max_batch']} per attention instance (scaled by the KV room left without "
              "expert weights: the B_AFD / B_base factor). ") if pd_extra else "") + (
             "The speedup model of pdjax.analysis.afd_speedup is (B_AFD/B_base) * (T_base/T_AFD) * M/(M+N); "
             f"e.g. afd_speedup(1.5, 1.15, 0.85) = {afd_speedup(1.5, 1.15, 0.85):.3f}.")
    return _result("AF-disaggregation M:N sweep", "afd_ratio_sweep", headline, rows, fig, notes, best=best["label"])


def run_link_bandwidth(cfg: dict, out_dir: str) -> Result:
    """Disaggregation gain against KV link bandwidth, next to the analytic handoff ratio
    t_comm / t_comp = KV_per_token * R_peak / (2 N_a BW) (1.9 % at 50 GB/s)."""
    from pdjax.analysis import handoff_to_prefill_ratio, kv_bytes_per_token, param_counts
    c = _parse(LinkBandwidthConfig, cfg)
    cost, hw, ep, _, model = build_cost(c)
    slo, target = _slo(c)
    sw = c.sweep
    n, p = sw.instances, sw.prefill
    kvb = kv_bytes_per_token(model, dtype_bytes=1 if c.hardware.dtype == "fp8" else 2)
    n_a = param_counts(model).active
    with progress.counter("link_bandwidth: colocated highest-rate search (simulations)") as advance:
        colo = _search(rate_runner(c.workload, Colocated(n, token_budget=sw.colocated_token_budget), cost, slo,
                                   c.search.duration), c, target, advance)["rate"]
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
    fig = _figure(figsize=(7, 4))
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
    ax.set_title(f"{p}P{n - p}D vs {n} colocated, {ep} x {hw.name}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    hi_r, lo_r = max(rows, key=lambda r: r["link_gbps_per_gpu"]), min(rows, key=lambda r: r["link_gbps_per_gpu"])
    at50 = [r for r in rows if r["link_gbps_per_gpu"] == 50.0]
    ref = at50[0] if at50 else hi_r
    keep = [r for r in rows if r["gain"] >= 0.95 * ref["gain"]]
    knee = min(keep, key=lambda r: r["link_gbps_per_gpu"]) if keep else ref
    headline = (f"at {ref['link_gbps_per_gpu']:g} GB/s the handoff is {ref['handoff_ratio']:.1%} of prefill compute "
                f"and PD sustains {ref['gain']:.2f}x the colocated rate; the gain holds down to "
                f"{knee['link_gbps_per_gpu']:g} GB/s (handoff {knee['handoff_ratio']:.0%} of prefill compute, "
                f"the link still keeps up) and falls to {lo_r['gain']:.2f}x at {lo_r['link_gbps_per_gpu']:g} GB/s "
                f"(handoff {lo_r['handoff_ratio']:.0%}, link utilisation {lo_r['link_utilisation']:.0%})")
    return _result("KV link bandwidth vs disaggregation gain", "link_bandwidth", headline, rows, fig,
                   colocated_max_rate=colo)


def run_prefix_cache_capacity(cfg: dict, out_dir: str) -> Result:
    """Prefix-cache hit rate and TTFT against store capacity (multi-turn + system prompts)."""
    c = _parse(PrefixCacheConfig, cfg)
    cost, hw, ep, link, _ = build_cost(c)
    slo, _ = _slo(c)
    sw = c.sweep
    n, p, bs = sw.instances, sw.prefill, sw.block_size
    reqs = workload_at_rate(c.workload, c.workload.rate)
    rows = []
    for cap_tokens in progress.track(sw.capacity_tokens, "prefix_cache_capacity: capacities"):
        cache = PrefixCache(cap_tokens // bs, bs, retention=sw.retention)
        s = simulate(PDDisaggregated(p, n - p, **_pd_kwargs(c, link)), cost, reqs, slo=slo, prefix_cache=cache).summary
        rows.append({"capacity_tokens": cap_tokens, "prefix_hit_rate": s["prefix_hit_rate"],
                     "block_hit_rate": cache.hit_rate(), "ttft_p50": s["ttft_p50"],
                     "ttft_p90": s["ttft_p90"], "util_prefill": s["util_prefill"],
                     "evicted_blocks": cache.evicted, "slo_attainment": s["slo_attainment"]})
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = [max(r["capacity_tokens"], bs) for r in rows]
    ax.plot(xs, [r["prefix_hit_rate"] for r in rows], "o-", label="prompt tokens served from cache")
    ax.set_xscale("log")
    ax.set_xlabel("prefix store capacity (tokens)")
    ax.set_ylabel("prefix hit rate")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["ttft_p90"] for r in rows], "s:", color="tab:red")
    ax2.set_ylabel("TTFT P90 (s)", color="tab:red")
    ax.set_title(f"Prefix cache, {p}P{n - p}D, block {bs} tokens")
    fig.tight_layout()
    top, zero = rows[-1], rows[0]
    headline = (f"prefix hit rate rises from {zero['prefix_hit_rate']:.1%} to {top['prefix_hit_rate']:.1%} "
                f"as the store grows to {top['capacity_tokens']:,} tokens; TTFT P90 "
                f"{zero['ttft_p90'] * 1e3:.0f} -> {top['ttft_p90'] * 1e3:.0f} ms")
    return _result("Prefix-cache hit rate vs capacity", "prefix_cache_capacity", headline, rows, fig)


RUNNERS = {"colocated_vs_pd": run_colocated_vs_pd, "pd_ratio_sweep": run_pd_ratio_sweep,
           "afd_ratio_sweep": run_afd_ratio_sweep, "link_bandwidth": run_link_bandwidth,
           "prefix_cache_capacity": run_prefix_cache_capacity}
