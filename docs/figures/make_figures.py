"""Regenerate the figures of docs/concepts.md with pdjax's own analysis, schedule
simulator, DBO timeline and serving simulator (no number here is typed in: every value
plotted comes from a pdjax function).

    .venv/bin/python docs/figures/make_figures.py            # all figures
    .venv/bin/python docs/figures/make_figures.py dbo mla_kv # some of them

Pure Python + numpy + matplotlib (no jax); about 10 s. PNGs are written next to this file.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from matplotlib.figure import Figure

import pdjax
from pdjax import analysis as A
from pdjax import pipeline as pp
from pdjax import sim
from pdjax.parallel.dbo import dbo_gain, overlap_timeline
from pdjax.schedules.gantt import draw as draw_gantt

HERE = os.path.dirname(os.path.abspath(__file__))
DPI = 90


def _save(fig: Figure, name: str) -> str:
    path = os.path.join(HERE, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def workloads() -> Figure:
    """Roofline of an H800 (bf16): decode at small batches sits on the bandwidth slope,
    prefill on the compute roof; MLA lifts attention's intensity."""
    hw, v3 = A.hardware("h800"), pdjax.configs.deepseek_v3()
    peak = hw.peak_flops("bf16")
    balance = A.machine_balance(hw, "bf16")
    x = np.logspace(-0.5, 4, 200)
    fig = Figure(figsize=(7.5, 3.8))
    ax = fig.subplots()
    ax.loglog(x, [peak * A.roofline.utilisation_bound(a, balance) / 1e12 for a in x], color="black", lw=1.5)
    ax.axvline(balance, color="grey", ls=":", lw=1)
    ax.text(balance * 1.15, peak / 1e12 * 0.004, f"machine balance\nA* = {balance:.0f} FLOP/B", color="grey",
            fontsize=8)
    # (label, intensity, colour, label offset in points)
    points = [("decode weights, B = 1\n= MHA attention (any S)", A.weight_intensity(1, 2), "tab:blue", (8, 6)),
              ("decode weights, B = 16", A.weight_intensity(16, 2), "tab:blue", (8, -14)),
              ("MLA attention, DeepSeek-V3", A.attention_intensity(v3, "mla", 2), "tab:green", (-190, -3)),
              ("decode weights, B = 128", A.weight_intensity(128, 2), "tab:blue", (-175, 8)),
              ("prefill weights, B = 4096", A.weight_intensity(4096, 2), "tab:red", (-130, -34))]
    for label, a, color, offset in points:
        y = peak * A.roofline.utilisation_bound(a, balance) / 1e12
        ax.plot([a], [y], "o", color=color)
        ax.annotate(f"{label}: {a:.3g} FLOP/B, {A.roofline.utilisation_bound(a, balance):.1%} of peak", (a, y),
                    textcoords="offset points", xytext=offset, fontsize=7, color=color)
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"Roofline of {hw.name} (bf16): {peak / 1e12:.0f} TFLOP/s, {hw.hbm_bw / 1e12:.2f} TB/s")
    ax.set_ylim(peak / 1e12 * 1e-3, peak / 1e12 * 3)
    return fig


def mla_kv() -> Figure:
    """KV bytes per token of DeepSeek-V3 by attention kind, and the sequences that fit on
    an H800 decode GPU (fp8 weights over EP144) against the context length."""
    v3, hw = pdjax.configs.deepseek_v3(), A.hardware("h800")
    serving = A.published.DEEPSEEK_V3_SERVING
    kinds = [("MHA", "mha", {}), ("GQA, 8 groups", "gqa", {"num_kv_groups": 8}),
             ("MQA", "mqa", {}), ("MLA", "mla", {})]
    kv = {label: A.kv_bytes_per_token(v3, 2, kind, **kw) for label, kind, kw in kinds}
    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    bars = ax1.bar(list(kv), [v / A.units.KiB for v in kv.values()],
                   color=["tab:purple", "tab:orange", "tab:grey", "tab:green"])
    ax1.set_yscale("log")
    ax1.bar_label(bars, [f"{v / A.units.KiB:,.1f} KiB" for v in kv.values()], fontsize=8)
    ax1.set_ylabel("KV cache per token (KiB, bf16, 61 layers)")
    ax1.set_title("DeepSeek-V3: KV bytes per token")
    weights = A.ep_weight_bytes_per_gpu(v3, serving.decode_ep, serving.weight_dtype_bytes)
    free = A.free_memory_bytes(hw.hbm_bytes, weights)
    contexts = np.geomspace(1024, 128 * 1024, 50)
    for label, color in (("MLA", "tab:green"), ("MHA", "tab:purple")):
        ax2.loglog(contexts, [A.concurrency_bound(free, int(s), kv[label], unit="B") for s in contexts],
                   color=color, label=label)
    ax2.axhline(1, color="grey", lw=0.8, ls=":")
    ax2.set_xlabel("context length S (tokens)")
    ax2.set_ylabel("sequences per GPU, C_max")
    ax2.set_title(f"{hw.name}, fp8 weights over EP{serving.decode_ep}: {free / A.units.GB:.1f} GB free")
    ax2.legend()
    return fig


def ep_all_to_all() -> Figure:
    """Decode step of DeepSeek-V3 per op (roofline cost model, bf16, H800) at 64 requests
    of 4,989 cached tokens per GPU, against the EP degree: expert weight reads shrink,
    the all-to-all grows towards 2 k D p per token per layer."""
    v3 = pdjax.configs.deepseek_v3()
    s = A.published.DEEPSEEK_V3_SERVING.mean_kv_len
    eps = (8, 16, 32, 64, 144, 256)
    ops = ("attention", "dense_mlp", "moe_experts", "all_to_all", "lm_head")
    colors = ("tab:green", "tab:olive", "tab:red", "tab:blue", "tab:grey")
    rows = []
    for ep in eps:
        m = A.RooflineCostModel(v3, "h800", dtype_bytes=2, ep_size=ep)
        rows.append(m.op_costs(kv_lens=[s] * (64 * ep)))
    fig = Figure(figsize=(9, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    bottom = np.zeros(len(eps))
    for op, color in zip(ops, colors):
        ms = np.array([1e3 * r[op].total_s for r in rows])
        ax1.bar([str(e) for e in eps], ms, bottom=bottom, color=color, label=op)
        bottom += ms
    ax1.set_xlabel("EP degree (GPUs per decode instance)")
    ax1.set_ylabel("decode step (ms, no overlap)")
    ax1.set_title("DeepSeek-V3 decode step by op, 64 req/GPU")
    ax1.legend(fontsize=7)
    per_token = [r["all_to_all"].link_bytes / 64 / A.units.KiB for r in rows]
    ax2.plot(eps, per_token, "o-", color="tab:blue", label="all-to-all bytes / token / MoE layer")
    ax2.set_xscale("log")
    ax2.set_xlabel("EP degree")
    ax2.set_ylabel("KiB per token per MoE layer")
    ax3 = ax2.twinx()
    ax3.plot(eps, [A.ep_weight_bytes_per_gpu(v3, e, 1, layout="replicated") / A.units.GB for e in eps], "s--",
             color="tab:red", label="weights per GPU (fp8, GB)")
    ax3.set_ylabel("weights per GPU (GB, fp8)")
    ax2.set_ylim(0, max(per_token) * 1.15)
    ax3.set_ylim(0, None)
    ax2.set_title("Wider EP: fewer weights, more traffic")
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower center")
    return fig


def _latencies(result) -> tuple[np.ndarray, np.ndarray]:
    done = [r for r in result.requests if r.status == "finished" and r.output_len > 1]
    ttft = np.array([r.t_first - r.arrival for r in done])
    tpot = np.array([(r.t_finish - r.t_first) / (r.output_len - 1) for r in done])
    return ttft, tpot


def pd_af() -> Figure:
    """Serving simulator: 4 instances colocated (chunked prefill with a 2048- or 512-token
    step budget) vs 2 prefill + 2 decode on the same workload (TTFT and TPOT
    distributions); AF ping-pong: the layer cycle against the exchange time for m
    micro-batches."""
    cost = sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=1500, rate=80.0, seed=0,
                                         input={"kind": "lognormal", "mean": 4096, "cv": 1.0, "high": 32768},
                                         output={"kind": "lognormal", "mean": 256, "cv": 0.8, "high": 1024}))
    slo = sim.SLO(ttft=2.0, tpot=0.02)
    deployments = {"colocated, 2048-token steps": (sim.Colocated(4, token_budget=2048), "tab:red"),
                   "colocated, 512-token steps": (sim.Colocated(4, token_budget=512), "tab:orange"),
                   "PD, 2 prefill + 2 decode": (sim.PDDisaggregated(2, 2, link_bw=32 * 50e9), "tab:blue")}
    fig = Figure(figsize=(11, 3.6))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for label, (dep, color) in deployments.items():
        res = sim.simulate_serving(dep, cost, reqs, slo=slo)
        ttft, tpot = _latencies(res)
        q = np.linspace(0, 1, len(ttft))
        ax1.plot(np.sort(ttft), q, color=color, label=f"{label}: P90 {res.summary['ttft_p90']:.2g} s")
        ax2.plot(1e3 * np.sort(tpot), q, color=color, label=f"P90 {1e3 * res.summary['tpot_p90']:.1f} ms")
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("time to first token, 4 x 32 H800, 80 req/s", fontsize=9)
    ax1.legend(fontsize=7, loc="lower right")
    ax2.set_xlabel("TPOT (ms)")
    ax2.set_title("time per output token", fontsize=9)
    ax2.legend(fontsize=7, loc="lower right")
    ratios = np.linspace(0, 1.2, 121)
    for m, color in ((2, "tab:orange"), (3, "tab:green"), (4, "tab:purple")):
        cycle = [sim.afd_layer_cycle(1.0, 1.0, r, m) / m for r in ratios]
        ax3.plot(ratios, cycle, color=color, label=f"m = {m}")
    for r in (0.5, 1.0):
        m_min = A.afd_min_microbatches(r, 1.0)
        ax3.annotate(f"T_c/T_f = {r:g}: m >= {m_min:g}", (r, 1.0), textcoords="offset points",
                     xytext=(-60, 30 + 20 * r), fontsize=7, arrowprops={"arrowstyle": "->", "lw": 0.6})
    ax3.set_xlabel("exchange time T_c / FFN time T_f (T_a = T_f)")
    ax3.set_ylabel("layer time per micro-batch / T_f")
    ax3.set_title("AF ping-pong: hidden while flat", fontsize=9)
    ax3.legend(fontsize=7)
    return fig


def pipeline_gantt() -> Figure:
    """1F1B, ZB1P and DualPipe on 8 ranks, 20 micro-batches, F = 1, B = 2, W = 1, F&B = 2.5."""
    costs = dict(F=1.0, B=2.0, W=1.0)
    names = ("1f1b", "zb1p", "dualpipe")
    timelines = [pp.simulate(pp.build(n, 8, 20), **costs, **({"FB": 2.5} if n == "dualpipe" else {}))
                 for n in names]
    fig = Figure(figsize=(10, 7.5))
    axes = fig.subplots(3, 1)
    longest = max(t.makespan for t in timelines)
    for ax, name, t in zip(axes, names, timelines):
        draw_gantt(t, ax=ax, title=f"{name}: makespan {t.makespan:g}, bubble ratio {t.bubble_ratio:.1%}")
        ax.set_xlim(0, longest)
    return fig


def pipeline_bubbles() -> Figure:
    """Bubble ratio against micro-batches at 16 stages: the 1F1B closed form and the
    simulated schedules (DualPipeV on 8 ranks, the same 16 stages)."""
    costs = dict(F=1.0, B=2.0, W=1.0)
    ms = (32, 48, 64, 96, 128, 192, 256)
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    ax.plot(ms, [100 * A.bubble_ratio_1f1b(16, m) for m in ms], "k--", label="1F1B (P-1)/(m+P-1)")
    for name, ranks, color in (("1f1b", 16, "tab:grey"), ("zb1p", 16, "tab:green"),
                               ("dualpipe", 16, "tab:orange"), ("dualpipev", 8, "tab:red")):
        extra = {"FB": 2.5} if name.startswith("dualpipe") else {}
        ratios = [100 * pp.simulate(pp.build(name, ranks, m), **costs, **extra).bubble_ratio for m in ms]
        ax.plot(ms, ratios, "o-", ms=3, color=color, label=f"{name}, {ranks} ranks (simulated)")
    ax.axhline(10, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.minorticks_off()
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble ratio (%)")
    ax.set_title("16 pipeline stages, F = 1, B = 2, W = 1, F&B = 2.5")
    ax.legend(fontsize=7)
    return fig


def dbo() -> Figure:
    """Dual-batch overlap on two streams (compute, communication): one MoE layer pair
    without and with DBO at communication = compute, and the predicted speed-up."""
    args = dict(t_attn=1.0, t_experts=1.0, t_dispatch=1.0, t_combine=1.0, num_layers=2)
    fig = Figure(figsize=(11, 3.2))
    gs = fig.add_gridspec(2, 2, width_ratios=(2, 1))
    # event names: kind letter (Attention, Experts, Dispatch, Combine), micro-batch, layer
    colors = {"A": "tab:green", "E": "tab:red", "D": "tab:blue", "C": "tab:cyan"}
    for row, flag in enumerate((False, True)):
        ax = fig.add_subplot(gs[row, 0])
        tl = overlap_timeline(**args, dbo=flag)
        for stream, name, start, end in tl["events"]:
            y = 1 if stream == "compute" else 0
            ax.barh(y, end - start, left=start, color=colors[name[0]], edgecolor="white", height=0.7)
            ax.text((start + end) / 2, y, name, ha="center", va="center", fontsize=6)
        ax.set_yticks([0, 1], ["comm", "compute"])
        if row == 0:
            ax.tick_params(labelbottom=False)
        ax.set_xlim(0, overlap_timeline(**args, dbo=False)["makespan"])
        ax.set_title(f"{'DBO (2 micro-batches)' if flag else 'no overlap'}: makespan {tl['makespan']:g}",
                     fontsize=9)
    ax = fig.add_subplot(gs[:, 1])
    ratios = np.geomspace(1 / 16, 16, 65)
    ax.semilogx(ratios, [dbo_gain(1.0, r, num_layers=8) for r in ratios], color="tab:blue")
    ax.set_xlabel("communication / compute")
    ax.set_ylabel("predicted speed-up")
    ax.set_title("dbo_gain, 8 layers")
    return fig


FIGURES = {"workloads": workloads, "mla_kv": mla_kv, "ep_all_to_all": ep_all_to_all, "pd_af": pd_af,
           "pipeline_gantt": pipeline_gantt, "pipeline_bubbles": pipeline_bubbles, "dbo": dbo}


def main(names=None) -> list[str]:
    names = list(names or FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise SystemExit(f"unknown figure(s) {unknown}; known: {sorted(FIGURES)}")
    paths = [_save(FIGURES[n](), n) for n in names]
    for p in paths:
        print(f"{os.path.relpath(p)}  {os.path.getsize(p) / 1024:.0f} KiB")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
