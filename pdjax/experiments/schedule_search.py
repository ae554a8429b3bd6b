"""Experiment: the memory-makespan Pareto frontier of :func:`pdjax.schedules.search`.

For every F:B:W ratio x link latency of the config, one search over the families (its pool
of hand-written and greedy schedules does not depend on the budget, so one run gives every
candidate): the frontier of (peak memory, makespan) with the hand-written schedules marked
on the same axes, and for each memory budget (a multiple of 1F1B's peak, ``P`` micro-batch
activations of a rank) the best makespan against the proven lower bound (the gap). With
``[execute] enabled``, the search is run again at the executor's size and its top schedule
is executed on a tiny model (:func:`pdjax.pipeline.measurement.measure_schedule`): measured
bubble ratio beside the simulated one.

``scale`` multiplies ``num_microbatches``.
"""

from __future__ import annotations

import dataclasses
import time

from pdjax.experiments import progress
from pdjax.experiments.results import Result
from pdjax.experiments.schema import Header, knob, table

FAMILY_CHOICES = ("zb", "v", "dualpipe")
HAND = ("1f1b", "zb1p", "zbh2", "dualpipev", "zbv", "v-half", "v-min", "dualpipe")


@dataclasses.dataclass(frozen=True)
class Search:
    num_ranks: int = knob(8, minimum=1)                   # P
    num_microbatches: int = knob(32, minimum=1)           # m (times scale)
    families: list[str] = knob(list(FAMILY_CHOICES), choices=FAMILY_CHOICES, nonempty=True)
    budgets_x_1f1b: list[float] = knob([0.5, 1.0, 2.0], above=0, nonempty=True)   # x P activations
    time_limit_s: float = knob(120.0, above=0)            # per search; the pool should complete
    milp_max_ops: int = knob(0, minimum=0)                # 0: no MILP (P x m = 256 is beyond it)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per rank of a one-stage-per-rank pipeline: ``ratios`` are ``[F, B, W]`` (B the full
    backward, I = B - W), ``comms`` the link latencies, in the same unit."""

    ratios: list[list[float]] = knob([[1.0, 2.0, 1.0], [1.0, 2.0, 0.5]], minimum=0, nonempty=True)
    comms: list[float] = knob([0.0, 0.1], minimum=0, nonempty=True)

    def __post_init__(self):
        for i, r in enumerate(self.ratios):
            if len(r) != 3 or any(not v >= 0 for v in r):
                raise ValueError(f"ratios[{i}]: expected [F, B, W], each >= 0, got {r!r}")
            if r[2] > r[1]:
                raise ValueError(f"ratios[{i}]: W ({r[2]:g}) must not exceed B ({r[1]:g})")


@dataclasses.dataclass(frozen=True)
class Execute:
    """Execute the top schedule of a search at ``ranks`` x ``microbatches`` (first ratio,
    first latency) on the ``tiny`` model with ``layers`` decoder layers."""

    enabled: bool = knob(True)
    ranks: int = knob(2, minimum=1)
    microbatches: int = knob(8, minimum=1)
    layers: int = knob(4, minimum=1)
    rows: int = knob(4, minimum=1)
    seq_len: int = knob(32, minimum=2)
    repeats: int = knob(3, minimum=1)
    op_repeats: int = knob(3, minimum=1)
    cluster: bool = knob(True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Header):
    search: Search = table(Search)
    costs: Costs = table(Costs)
    execute: Execute = table(Execute)

    def __post_init__(self):
        super().__post_init__()
        sizes = [("search.num_microbatches", self.search.num_microbatches * self.scale)]
        if self.execute.enabled:
            sizes.append(("execute.microbatches", self.execute.microbatches))
        for key, m in sizes:       # DualPipe lets half the micro-batches in at each end
            if set(self.search.families) == {"dualpipe"} and m % 2:
                raise ValueError(f"{key}: the dualpipe family alone needs an even number of micro-batches, "
                                 f"got {m}")

    def devices_needed(self) -> int:
        e = self.execute
        return e.ranks if e.enabled and not e.cluster else 0


def _kind(label: str) -> str:
    return "hand-written" if label in HAND else ("milp" if label.startswith("milp") else "greedy")


def run(c: Config, out_dir: str) -> Result:
    from pdjax.schedules.search import search

    s = c.search
    p, m = s.num_ranks, s.num_microbatches * c.scale
    settings = [(tuple(r), comm) for r in c.costs.ratios for comm in c.costs.comms]
    points, gaps, per_setting, wall = [], [], {}, {}
    for ratio, comm in progress.track(settings, "schedule search: F:B:W x comm"):
        F, B, W = ratio
        t0 = time.perf_counter()
        res = search(p, m, F=F, B=B, W=W, comm=comm, families=s.families, time_limit_s=s.time_limit_s,
                     milp_max_ops=s.milp_max_ops)
        key = f"F:B:W={F:g}:{B:g}:{W:g} comm={comm:g}"
        wall[key] = {"search_s": time.perf_counter() - t0}
        front = set(res.frontier)
        for cd in res.candidates:
            points.append({"ratio": f"{F:g}:{B:g}:{W:g}", "comm": comm, "family": cd.family, "label": cd.label,
                           "kind": _kind(cd.label), "peak_memory": cd.peak_memory, "makespan": cd.makespan,
                           "on_frontier": (round(cd.peak_memory, 9), round(cd.makespan, 9)) in front})
        rows = []
        for x in s.budgets_x_1f1b:
            budget = x * p
            fit = [cd for cd in res.candidates if cd.peak_memory <= budget + 1e-9]
            best = min(fit, key=lambda cd: (cd.makespan, cd.peak_memory)) if fit else None
            row = {"ratio": f"{F:g}:{B:g}:{W:g}", "comm": comm, "budget_x_1f1b": x, "budget": budget,
                   "best": best.label if best else "none fits", "family": best.family if best else "",
                   "makespan": best.makespan if best else float("nan"), "lower_bound": res.lower_bound,
                   "gap": best.makespan / res.lower_bound - 1.0 if best and res.lower_bound > 0 else float("nan")}
            rows.append(row)
        gaps += rows
        per_setting[key] = {"complete": res.complete, "lower_bound": res.lower_bound,
                            "frontier": [list(pt) for pt in res.frontier],
                            "gaps": {f"{r['budget_x_1f1b']:g}x": r["gap"] for r in rows}}
    metrics = {"P": p, "m": m, "settings": per_setting}
    body = ("Every candidate of each search (hand-written, memory-capped greedy) as (peak memory per rank, "
            "makespan); memory in micro-batch activations of one rank's layers (1F1B peaks at P, dotted line); "
            "the plot shows makespans up to 1.6x the least (all of them are in candidates.csv). "
            "The gap table: the best candidate within each budget against the proven lower bound "
            "(`pdjax.pipeline.lower_bound`, which ignores memory).\n\n" + _markdown(gaps))
    tables = {"candidates": points, "gaps": gaps}
    objects, measured = {}, ()
    if c.execute.enabled:
        row = _execute(c)
        tables["executed"] = [row]
        measured = ("executed",)
        wall["executed"] = row
        body += (f"\n\nExecuted: `{row['label']}` (searched at {row['ranks']} ranks x {row['microbatches']} "
                 f"micro-batches) on the tiny model: measured bubble ratio {row['measured_bubble_ratio']:.3f}, "
                 f"simulated with the measured op times {row['simulated_bubble_ratio']:.3f}, simulated with "
                 f"the search's unit costs {row['search_bubble_ratio']:.3f}.")
    worst = max((g for g in gaps if g["gap"] == g["gap"]), key=lambda g: g["gap"], default=None)
    headline = (f"P={p}, m={m}: {len(points)} candidates over {len(settings)} cost settings; largest gap to the "
                f"lower bound {100 * worst['gap']:.1f}% ({worst['ratio']}, comm {worst['comm']:g}, budget "
                f"{worst['budget_x_1f1b']:g}x 1F1B)" if worst else f"P={p}, m={m}: no candidate fits a budget")
    return Result("Schedule search: memory-makespan frontier", headline, metrics=metrics, wall_clock=wall,
                  tables=tables, measured_tables=measured,
                  figures={"frontier": figure(points, settings, p)}, body=body, objects=objects)


def _markdown(gaps: list[dict]) -> str:
    lines = ["| F:B:W | comm | budget (x 1F1B) | best | makespan | lower bound | gap |", "|---|---|---|---|---|---|---|"]
    for g in gaps:
        lines.append(f"| {g['ratio']} | {g['comm']:g} | {g['budget_x_1f1b']:g} | {g['best']} | {g['makespan']:.2f} "
                     f"| {g['lower_bound']:.2f} | {100 * g['gap']:.1f}% |")
    return "\n".join(lines)


def figure(points: list[dict], settings, p: int):
    from pdjax.schedules.figure import Figure    # not pyplot: the user's backend stays as it is

    cols = min(2, len(settings))
    rows = -(-len(settings) // cols)
    fig = Figure(figsize=(5.5 * cols, 4.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(settings):]:
        ax.set_visible(False)
    for ax, (ratio, comm) in zip(axes.flat, settings):
        name = f"{ratio[0]:g}:{ratio[1]:g}:{ratio[2]:g}"
        pts = [q for q in points if q["ratio"] == name and q["comm"] == comm]
        greedy = [q for q in pts if q["kind"] != "hand-written"]
        ax.scatter([q["peak_memory"] for q in greedy], [q["makespan"] for q in greedy], s=8, c="0.7",
                   label="greedy")
        front = sorted((q["peak_memory"], q["makespan"]) for q in pts if q["on_frontier"])
        if front:
            xs, ys = zip(*front)
            ax.step(xs, ys, where="post", c="k", lw=1, label="frontier")
        for q in pts:
            if q["kind"] == "hand-written":
                ax.scatter([q["peak_memory"]], [q["makespan"]], s=24, marker="D")
                ax.annotate(q["label"], (q["peak_memory"], q["makespan"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        ax.axvline(p, c="0.5", ls=":", lw=1)
        if pts:   # zoom on the interesting part: makespans up to 1.6x the least
            low = min(q["makespan"] for q in pts)
            ax.set_ylim(0.97 * low, 1.6 * low)
        ax.set_title(f"F:B:W {name}, comm {comm:g}", fontsize=9)
        ax.set_xlabel("peak memory per rank (x one micro-batch of a rank)")
        ax.set_ylabel("makespan")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _execute(c: Config) -> dict:
    import jax
    import numpy as np

    import pdjax
    from pdjax.pipeline.measurement import measure_schedule
    from pdjax.schedules.search import search

    e = c.execute
    F, B, W = c.costs.ratios[0]
    res = search(e.ranks, e.microbatches, F=F, B=B, W=W, comm=c.costs.comms[0], families=c.search.families,
                 time_limit_s=c.search.time_limit_s, milp_max_ops=c.search.milp_max_ops)
    base = pdjax.configs.preset("tiny")
    mcfg = base.replace(num_hidden_layers=e.layers, first_k_dense_replace=min(1, e.layers))
    params = pdjax.init_params(mcfg, jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, mcfg.vocab_size, (e.microbatches * e.rows, e.seq_len),
                                               dtype=np.int32)
    row = measure_schedule(res.schedule, mcfg, params=params, tokens=tokens, repeats=e.repeats,
                           op_repeats=e.op_repeats, cluster=e.cluster)
    return {"label": res.label, "ranks": e.ranks, "microbatches": e.microbatches,
            "search_makespan": res.makespan, "search_bubble_ratio": res.timeline.bubble_ratio,
            "measured_makespan_ms": row.measured_makespan_ms, "simulated_makespan_ms": row.simulated_makespan_ms,
            "measured_bubble_ratio": row.measured_bubble_ratio, "simulated_bubble_ratio": row.simulated_bubble_ratio}
