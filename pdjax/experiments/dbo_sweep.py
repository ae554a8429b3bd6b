"""Experiment: predicted dual-batch-overlap gain against the compute:communication ratio.

For each ratio r = T_comm / T_compute the two-stream timeline model
(:func:`pdjax.parallel.overlap_timeline`) gives the step time with and without DBO; the
gain is their quotient. DeepSeek-V3's cross-node EP training sits near r = 1. ``scale``
multiplies ``num_layers``.
"""

from __future__ import annotations

import dataclasses

from pdjax.experiments.results import Result, markdown_table
from pdjax.experiments.schema import Header, knob, table


@dataclasses.dataclass(frozen=True)
class Sweep:
    ratios: list[float] = knob([0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0], above=0, nonempty=True)
    attn_shares: list[float] = knob([0.3, 0.5, 0.7], minimum=0, nonempty=True)   # attention's part of compute
    num_layers: int = knob(8, minimum=1)

    def __post_init__(self):
        if max(self.attn_shares) > 1:
            raise ValueError(f"attn_shares: each must lie in [0, 1], got {self.attn_shares}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    sweep: Sweep = table(Sweep)


def _figure(rows: list[dict], attn_shares, layers: int):
    from pdjax.schedules.figure import Figure
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for a in attn_shares:
        pts = [(r["comm_over_compute"], r["gain"]) for r in rows if r["attn_share"] == a]
        ax.plot(*zip(*pts), marker="o", label=f"attention share {a:g}")
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("communication : compute time")
    ax.set_ylabel("predicted DBO speed-up")
    ax.set_title(f"Dual-batch overlap, {layers} MoE layers (two-stream model)")
    ax.legend()
    fig.tight_layout()
    return fig


def run(c: Config, out_dir: str) -> Result:
    from pdjax.parallel.dbo import dbo_gain

    sweep = c.sweep
    layers = sweep.num_layers * c.scale
    rows = [{"comm_over_compute": r, "attn_share": a, "gain": dbo_gain(1.0, r, attn_share=a, num_layers=layers)}
            for a in sweep.attn_shares for r in sweep.ratios]
    best = max(rows, key=lambda r: r["gain"])
    at_one = [r for r in rows if r["comm_over_compute"] == 1.0 and r["attn_share"] == 0.5]
    headline = (f"DBO gain peaks at {best['gain']:.2f}x (comm:compute {best['comm_over_compute']:g}, "
                f"attention share {best['attn_share']:g})"
                + (f"; at 1:1 with an even split: {at_one[0]['gain']:.2f}x" if at_one else ""))
    metrics = {"num_layers": layers, "best_gain": best["gain"], "best_comm_over_compute": best["comm_over_compute"],
               "best_attn_share": best["attn_share"], "rows": rows}
    return Result("Dual-batch overlap gain", headline, metrics=metrics, tables={"dbo_gain": rows},
                  figures={"dbo_gain": _figure(rows, sweep.attn_shares, layers)}, body=markdown_table(rows))
