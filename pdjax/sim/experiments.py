"""Serving-simulator experiments: ``run_<name>(config, out_dir) -> summary``.

Each runner reads a TOML-derived dict (top-level ``kind`` and ``name``, then the tables
below), writes ``<name>.csv``, ``<name>.png`` and ``report.md`` into ``out_dir`` and returns
a summary with a one-line ``"headline"``. Shared tables:

* ``[model]`` ``preset`` (a pdjax.configs preset, default "deepseek_v3");
* ``[hardware]`` ``name`` (preset), ``dtype`` ("bf16"/"fp8"), ``ep_size`` (accelerators per
  instance), ``cost`` ("linear" = LinearStepCost.from_roofline, or "roofline" =
  pdjax.analysis.costmodel.RooflineCostModel), ``link_gbps_per_gpu`` (KV link, decimal
  GB/s per accelerator; default the preset's scale-out bandwidth);
* ``[workload]`` WorkloadSpec fields; ``[slo]`` ``ttft``, ``tpot`` (seconds), ``target``
  (attainment for the rate search, default 0.9); ``[search]`` ``lo``, ``hi`` (req/s).
"""

from __future__ import annotations

import csv
import math
import os

from pdjax.sim.cost import LinearStepCost
from pdjax.sim.deployment import Colocated, PDDisaggregated
from pdjax.sim.engine import simulate
from pdjax.sim.metrics import SLO
from pdjax.sim.prefix_cache import PrefixCache
from pdjax.sim.search import (_pick, af_ratio_sweep, max_rate_under_slo, pd_ratio_sweep,
                              rate_runner, sustained_output_rate, workload_at_rate)
from pdjax.sim.workload import workload_from_dict


# ---- shared parsing and output --------------------------------------------------------
def build_cost(cfg: dict):
    """(cost model, hardware spec, ep_size, per-instance link bytes/s) from a config."""
    import pdjax
    from pdjax.analysis import hardware
    model = pdjax.configs.preset(cfg.get("model", {}).get("preset", "deepseek_v3"))
    h = dict(cfg.get("hardware", {}))
    hw = hardware(h.get("name", "h800"))
    ep = int(h.get("ep_size", 1))
    dtype = h.get("dtype", "bf16")
    kind = h.get("cost", "linear")
    if kind == "linear":
        cost = LinearStepCost.from_roofline(model, hw, dtype=dtype, ep_size=ep,
                                            mfu=float(h.get("mfu", 1.0)), mbu=float(h.get("mbu", 1.0)))
    elif kind == "roofline":
        from pdjax.analysis.costmodel import RooflineCostModel
        cost = RooflineCostModel(model, hw, dtype_bytes=1 if dtype == "fp8" else 2, ep_size=ep)
    else:
        raise ValueError(f"[hardware] cost must be 'linear' or 'roofline', got {kind!r}")
    gbps = h.get("link_gbps_per_gpu")
    link = ep * (float(gbps) * 1e9 if gbps is not None else hw.link_bw("scale_out"))
    return cost, hw, ep, link, model


def _slo(cfg):
    s = dict(cfg.get("slo", {}))
    target = float(s.pop("target", 0.9))
    return SLO(**s), target


def _search(cfg):
    s = cfg.get("search", {})
    return float(s.get("lo", 0.25)), float(s.get("hi", 8.0))


def _duration(cfg):
    """Seconds of arrivals per simulated rate ([search] duration; None: the workload's
    num_requests at every rate)."""
    d = cfg.get("search", {}).get("duration")
    return None if d is None else float(d)


def _write_csv(rows, path):
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _figure(**kwargs):
    """A matplotlib Figure, drawn without pyplot (no global backend or figure state)."""
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def _report(out_dir, name, title, headline, rows, notes=""):
    cols = list(rows[0]) if rows else []
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                      + ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows])
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(f"# {title}\n\n{headline}\n\n![{name}]({name}.png)\n\n{notes}\n\n{table}\n\n"
                f"Data: {name}.csv. Model: discrete-event simulation (docs/sim.md).\n")
    print(headline)


def _pd_kwargs(cfg, link):
    d = dict(cfg.get("pd", {}))
    d.setdefault("link_bw", link)
    return d


# ---- experiments ----------------------------------------------------------------------
def run_colocated_vs_pd(cfg: dict, out_dir: str) -> dict:
    """Goodput over arrival rate: N colocated instances vs the same N split P + D."""
    cost, hw, ep, link, _ = build_cost(cfg)
    spec = workload_from_dict(cfg["workload"])
    slo, target = _slo(cfg)
    dep_cfg = cfg.get("deployment", {})
    n, p = int(dep_cfg.get("instances", 8)), int(dep_cfg.get("prefill", 4))
    colo = Colocated(n, token_budget=int(dep_cfg.get("colocated_token_budget", 2048)))
    pd = PDDisaggregated(p, n - p, **_pd_kwargs(cfg, link))
    rows = []
    for rate in cfg.get("sweep", {}).get("rates", [1, 2, 4, 8]):
        reqs = workload_at_rate(spec, float(rate), _duration(cfg))
        for label, dep in (("colocated", colo), (f"{p}P{n - p}D", pd)):
            s = simulate(dep, cost, reqs, slo=slo).summary
            rows.append({"rate": float(rate), "deployment": label, **_pick(s)})
    lo, hi = _search(cfg)
    best = {label: max_rate_under_slo(rate_runner(spec, dep, cost, slo, _duration(cfg)), lo=lo, hi=hi,
                                      target=target)["rate"]
            for label, dep in (("colocated", colo), (f"{p}P{n - p}D", pd))}
    _write_csv(rows, os.path.join(out_dir, "colocated_vs_pd.csv"))
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
    fig.suptitle(f"{n} instances of {ep} x {hw.name}: colocated vs PD (TTFT {slo.ttft:g} s, TPOT {slo.tpot * 1e3:g} ms)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "colocated_vs_pd.png"), dpi=110)
    (lc, rc), (lp, rp) = best.items()
    headline = (f"highest rate with {target:.0%} SLO attainment on {n} instances: {lc} {rc:.2f} req/s, "
                f"{lp} {rp:.2f} req/s ({(rp / rc - 1) * 100 if rc else math.inf:+.0f} % for PD)")
    _report(out_dir, "colocated_vs_pd", "Colocated vs PD-disaggregated goodput", headline, rows)
    return {"headline": headline, "max_rate": best, "rows": rows}


def run_pd_ratio_sweep(cfg: dict, out_dir: str) -> dict:
    """Mooncake-style P:D sweep at a fixed instance count: highest rate meeting the SLO."""
    cost, hw, ep, link, _ = build_cost(cfg)
    spec = workload_from_dict(cfg["workload"])
    slo, target = _slo(cfg)
    sw = cfg.get("sweep", {})
    total = int(sw.get("instances", 16))
    counts = sw.get("prefill", list(range(max(1, total // 2 - 3), min(total, total // 2 + 4))))
    lo, hi = _search(cfg)
    rows = pd_ratio_sweep(spec, cost, total, slo, prefill_counts=counts, lo=lo, hi=hi,
                          target=target, pd_kwargs=_pd_kwargs(cfg, link), duration=_duration(cfg))
    _write_csv(rows, os.path.join(out_dir, "pd_ratio_sweep.csv"))
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.bar(range(len(rows)), [r["max_rate"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows])
    ax.set_ylabel(f"highest rate at {target:.0%} SLO attainment (req/s)")
    ax.set_title(f"P:D sweep, {total} instances of {ep} x {hw.name}")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "pd_ratio_sweep.png"), dpi=110)
    best = max(rows, key=lambda r: (r["max_rate"], -r["P"]))
    headline = (f"best P:D on {total} instances: {best['label']} sustains {best['max_rate']:.2f} req/s "
                f"at {target:.0%} SLO attainment (range {min(r['max_rate'] for r in rows):.2f}-"
                f"{best['max_rate']:.2f} over {rows[0]['label']}..{rows[-1]['label']})")
    _report(out_dir, "pd_ratio_sweep", "P:D ratio sweep", headline, rows)
    return {"headline": headline, "best": best["label"], "rows": rows}


def run_afd_ratio_sweep(cfg: dict, out_dir: str) -> dict:
    """M:N sweep of one AF unit vs plain decode instances of the same count."""
    from pdjax.analysis import afd_speedup, attention_share
    cost, hw, ep, link, _ = build_cost(cfg)
    spec = workload_from_dict(cfg["workload"])
    slo, target = _slo(cfg)
    sw = cfg.get("sweep", {})
    pairs = [tuple(int(x) for x in p) for p in sw.get("pairs", [[6, 2], [5, 3], [4, 4]])]
    num_prefill = int(sw.get("prefill", 4))
    m = int(sw.get("microbatches", 3))
    lo, hi = _search(cfg)
    max_batch = sw.get("max_batch")          # per plain decode instance
    af_kwargs = {"link_bw": link, "exchange_bw": link}
    pd_extra = {}
    if max_batch is not None:
        # an attention instance holds no expert weights: its batch bound scales with its KV room
        cap, cap_a = getattr(cost, "kv_capacity", None), getattr(cost, "kv_capacity_attention", None)
        scale = cap_a / cap if cap and cap_a else 1.0
        af_kwargs["max_batch"] = max(1, int(max_batch * scale))
        pd_extra["max_batch"] = int(max_batch)
    rows = af_ratio_sweep(spec, cost, pairs, slo, num_prefill=num_prefill, microbatches=m, lo=lo,
                          hi=hi, target=target, af_kwargs=af_kwargs, duration=_duration(cfg))
    base = {}
    for size in sorted({r["decode_instances"] for r in rows}):
        run = rate_runner(spec, PDDisaggregated(num_prefill, size, link_bw=link, **pd_extra), cost, slo,
                          _duration(cfg))
        b = max_rate_under_slo(run, lo=lo, hi=hi, target=target)
        base[size] = (b["rate"], sustained_output_rate(spec, b["rate"], _duration(cfg)) / size)
    for r in rows:
        b_rate, b_tok = base[r["decode_instances"]]
        r["baseline_max_rate"] = b_rate
        r["speedup_vs_plain_decode"] = r["output_tok_s_per_decode_instance"] / b_tok if b_tok else math.nan
        r["attention_share"] = attention_share(r["M"], r["N"])
    _write_csv(rows, os.path.join(out_dir, "afd_ratio_sweep.csv"))
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    xs = range(len(rows))
    ax.bar(xs, [r["output_tok_s_per_decode_instance"] for r in rows], color="tab:green",
           label=f"AF unit, m = {m}")
    ax.plot(xs, [base[r["decode_instances"]][1] for r in rows], "k--o",
            label="plain decode, same instance count")
    ax.set_xticks(xs, [r["label"] for r in rows])
    ax.set_ylabel("sustained output tok/s per decode-side\ninstance at the highest SLO-meeting rate")
    ax.set_title(f"AFD M:N sweep, {ep} x {hw.name} per instance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "afd_ratio_sweep.png"), dpi=110)
    best = max(rows, key=lambda r: r["output_tok_s_per_decode_instance"])
    headline = (f"best AF ratio {best['label']} (m = {m}): {best['output_tok_s_per_decode_instance']:.0f} "
                f"output tok/s per decode-side instance, {best['speedup_vs_plain_decode']:.2f}x plain decode "
                f"with the same instance count; M/(M+N) = {best['attention_share']:.2f}")
    notes = ((f"Batch bound: {pd_extra['max_batch']} requests per plain decode instance, "
              f"{af_kwargs['max_batch']} per attention instance (scaled by the KV room left without "
              "expert weights: the B_AFD / B_base factor). ") if pd_extra else "") + (
             "The speedup model of pdjax.analysis.afd_speedup is (B_AFD/B_base) * (T_base/T_AFD) * M/(M+N); "
             f"e.g. afd_speedup(1.5, 1.15, 0.85) = {afd_speedup(1.5, 1.15, 0.85):.3f}.")
    _report(out_dir, "afd_ratio_sweep", "AF-disaggregation M:N sweep", headline, rows, notes)
    return {"headline": headline, "best": best["label"], "rows": rows}


def run_link_bandwidth(cfg: dict, out_dir: str) -> dict:
    """Disaggregation gain against KV link bandwidth, next to the analytic handoff ratio
    t_comm / t_comp = KV_per_token * R_peak / (2 N_a BW) (1.9 % at 50 GB/s)."""
    from pdjax.analysis import handoff_to_prefill_ratio, kv_bytes_per_token, param_counts
    cost, hw, ep, _, model = build_cost(cfg)
    spec = workload_from_dict(cfg["workload"])
    slo, target = _slo(cfg)
    sw = cfg.get("sweep", {})
    n, p = int(sw.get("instances", 8)), int(sw.get("prefill", 4))
    lo, hi = _search(cfg)
    dtype = cfg.get("hardware", {}).get("dtype", "bf16")
    kvb = kv_bytes_per_token(model, dtype_bytes=1 if dtype == "fp8" else 2)
    n_a = param_counts(model).active
    colo = max_rate_under_slo(rate_runner(spec, Colocated(n, token_budget=int(sw.get(
        "colocated_token_budget", 2048))), cost, slo, _duration(cfg)), lo=lo, hi=hi, target=target)["rate"]
    rows = []
    for gbps in sw.get("link_gbps_per_gpu", [0.5, 1, 2, 5, 10, 25, 50, 100]):
        link = ep * float(gbps) * 1e9
        run = rate_runner(spec, PDDisaggregated(p, n - p, link_bw=link), cost, slo, _duration(cfg))
        best = max_rate_under_slo(run, lo=lo, hi=hi, target=target)
        s = best["summary"]
        rows.append({"link_gbps_per_gpu": float(gbps),
                     "handoff_ratio": handoff_to_prefill_ratio(kvb, n_a, hw.peak_flops(dtype), float(gbps) * 1e9),
                     "pd_max_rate": best["rate"], "colocated_max_rate": colo,
                     "gain": best["rate"] / colo if colo else math.nan,
                     "kv_wait_p90": s.get("kv_wait_p90", math.nan), "link_utilisation": s["link_utilisation"]})
    _write_csv(rows, os.path.join(out_dir, "link_bandwidth.csv"))
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
    fig.savefig(os.path.join(out_dir, "link_bandwidth.png"), dpi=110)
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
    _report(out_dir, "link_bandwidth", "KV link bandwidth vs disaggregation gain", headline, rows)
    return {"headline": headline, "rows": rows}


def run_prefix_cache_capacity(cfg: dict, out_dir: str) -> dict:
    """Prefix-cache hit rate and TTFT against store capacity (multi-turn + system prompts)."""
    cost, hw, ep, link, _ = build_cost(cfg)
    spec = workload_from_dict(cfg["workload"])
    slo, _ = _slo(cfg)
    sw = cfg.get("sweep", {})
    n, p = int(sw.get("instances", 4)), int(sw.get("prefill", 2))
    bs = int(sw.get("block_size", 64))
    reqs = workload_at_rate(spec, spec.rate)
    rows = []
    for cap_tokens in sw.get("capacity_tokens", [0, 16384, 65536, 262144, 1048576, 4194304]):
        cache = PrefixCache(int(cap_tokens) // bs, bs, retention=sw.get("retention"))
        s = simulate(PDDisaggregated(p, n - p, **_pd_kwargs(cfg, link)), cost, reqs, slo=slo,
                     prefix_cache=cache).summary
        rows.append({"capacity_tokens": int(cap_tokens), "prefix_hit_rate": s["prefix_hit_rate"],
                     "block_hit_rate": cache.hit_rate(), "ttft_p50": s["ttft_p50"],
                     "ttft_p90": s["ttft_p90"], "util_prefill": s["util_prefill"],
                     "evicted_blocks": cache.evicted, "slo_attainment": s["slo_attainment"]})
    _write_csv(rows, os.path.join(out_dir, "prefix_cache_capacity.csv"))
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
    fig.savefig(os.path.join(out_dir, "prefix_cache_capacity.png"), dpi=110)
    top, zero = rows[-1], rows[0]
    headline = (f"prefix hit rate rises from {zero['prefix_hit_rate']:.1%} to {top['prefix_hit_rate']:.1%} "
                f"as the store grows to {top['capacity_tokens']:,} tokens; TTFT P90 "
                f"{zero['ttft_p90'] * 1e3:.0f} -> {top['ttft_p90'] * 1e3:.0f} ms")
    _report(out_dir, "prefix_cache_capacity", "Prefix-cache hit rate vs capacity", headline, rows)
    return {"headline": headline, "rows": rows}


RUNNERS = {"colocated_vs_pd": run_colocated_vs_pd, "pd_ratio_sweep": run_pd_ratio_sweep,
           "afd_ratio_sweep": run_afd_ratio_sweep, "link_bandwidth": run_link_bandwidth,
           "prefix_cache_capacity": run_prefix_cache_capacity}
