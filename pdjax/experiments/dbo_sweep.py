"""Experiment: predicted dual-batch-overlap gain against the compute:communication ratio.

For each ratio r = T_comm / T_compute the two-stream timeline model
(:func:`pdjax.parallel.overlap_timeline`) gives the step time with and without DBO; the
gain is their quotient. DeepSeek-V3's cross-node EP training sits near r = 1. ``scale``
multiplies ``num_layers``.
"""

from __future__ import annotations

from pdjax.experiments import schema
from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.runner import with_defaults
from pdjax.parallel.dbo import dbo_gain

DEFAULTS = {"sweep": {"ratios": [0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0],
                      "attn_shares": [0.3, 0.5, 0.7], "num_layers": 8}}
CONFIG = schema.from_defaults("dbo_sweep", DEFAULTS)


def run_dbo_sweep(cfg: dict, out_dir: str) -> Result:
    sweep = with_defaults(cfg, DEFAULTS, "dbo_sweep")["sweep"]
    ratios = sweep["ratios"]
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"sweep.ratios: must be positive numbers, got {ratios}")
    layers = sweep["num_layers"] * cfg.get("scale", 1)
    rows = [{"comm_over_compute": r, "attn_share": a, "gain": dbo_gain(1.0, r, attn_share=a, num_layers=layers)}
            for a in sweep["attn_shares"] for r in ratios]
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for a in sweep["attn_shares"]:
        pts = [(r["comm_over_compute"], r["gain"]) for r in rows if r["attn_share"] == a]
        ax.plot(*zip(*pts), marker="o", label=f"attention share {a:g}")
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("communication : compute time")
    ax.set_ylabel("predicted DBO speed-up")
    ax.set_title(f"Dual-batch overlap, {layers} MoE layers (two-stream model)")
    ax.legend()
    fig.tight_layout()
    best = max(rows, key=lambda r: r["gain"])
    at_one = [r for r in rows if r["comm_over_compute"] == 1.0 and r["attn_share"] == 0.5]
    headline = (f"DBO gain peaks at {best['gain']:.2f}x (comm:compute {best['comm_over_compute']:g}, "
                f"attention share {best['attn_share']:g})"
                + (f"; at 1:1 with an even split: {at_one[0]['gain']:.2f}x" if at_one else ""))
    metrics = {"num_layers": layers, "best_gain": best["gain"], "best_comm_over_compute": best["comm_over_compute"],
               "best_attn_share": best["attn_share"], "rows": rows}
    return Result("Dual-batch overlap gain", headline, metrics=metrics, tables={"dbo_gain": rows},
                  figures={"dbo_gain": fig}, body=markdown_table(rows))
