"""The bubble-sweep experiment: every schedule x P x m, simulated vs formula.

Config (see experiments/bubble_sweep.toml)::

    [sweep]
    schedules = ["gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev"]
    num_stages = [4, 8, 16, 32]          # P (DualPipeV runs P stages on P/2 ranks)
    microbatch_multipliers = [1, 2, 4, 8]  # m = k * P
    num_stages_per_rank = 2              # interleaved-1f1b only
    [costs]                              # per-op times, one unit (e.g. ms)
    F = 1.0
    B = 2.0
    W = 1.0
    FB = 2.5
    comm = 0.0

:func:`run_bubble_sweep` writes ``bubble_sweep.csv`` and ``bubble_sweep.png`` into
``out_dir`` and returns a headline summary; :func:`grid`, :func:`sweep_row`,
:func:`summarize` and :func:`figure` are its parts (``pdjax run`` drives them itself).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .generators import GENERATORS
from .comparison import ReportRow, compare_one

_COST_KEYS = ("F", "B", "W", "FB", "comm")


def _table(config: dict, key: str) -> dict:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"config [{key}] must be a table, got {type(value).__name__}")
    return value


def _int_list(sweep: dict, key: str, default: list[int]) -> list[int]:
    values = sweep.get(key, default)
    if not isinstance(values, list) or not values:
        raise ValueError(f"sweep.{key} must be a non-empty list of positive ints, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"sweep.{key} must hold positive ints, got {v!r}")
    return values


def parse_config(config: dict) -> dict:
    """Validate a sweep config dict; returns normalised settings."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    sweep, costs = _table(config, "sweep"), _table(config, "costs")
    unknown = set(sweep) - {"schedules", "num_stages", "microbatch_multipliers", "num_stages_per_rank"}
    if unknown:
        raise ValueError(f"unknown sweep keys {sorted(unknown)}")
    schedules = sweep.get("schedules", list(GENERATORS))
    if not isinstance(schedules, list) or not schedules:
        raise ValueError(f"sweep.schedules must be a non-empty list, got {schedules!r}")
    for name in schedules:
        if name not in GENERATORS:
            raise ValueError(f"sweep.schedules: unknown schedule name {name!r}; known: {sorted(GENERATORS)}")
    bad = set(costs) - set(_COST_KEYS)
    if bad:
        raise ValueError(f"unknown costs keys {sorted(bad)}; allowed: {list(_COST_KEYS)}")
    cost_values = {"F": 1.0, "B": 2.0, "W": 1.0, "FB": None, "comm": 0.0}
    for k, v in costs.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"costs.{k} must be a finite number >= 0, got {v!r}")
        cost_values[k] = float(v)
    v = sweep.get("num_stages_per_rank", 2)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"sweep.num_stages_per_rank must be a positive int, got {v!r}")
    return {
        "schedules": schedules,
        "num_stages": _int_list(sweep, "num_stages", [4, 8, 16, 32]),
        "multipliers": _int_list(sweep, "microbatch_multipliers", [1, 2, 4, 8]),
        "num_stages_per_rank": v,
        "costs": cost_values,
    }


def grid(cfg: dict) -> list[tuple[str, int, int]]:
    """The (schedule, P, m) points of a parsed config, in table order (P, then schedule, then m)."""
    return [(name, p, k * p) for p in cfg["num_stages"] for name in cfg["schedules"] for k in cfg["multipliers"]]


def sweep_row(cfg: dict, point: tuple[str, int, int]) -> ReportRow:
    """One point of :func:`grid`, simulated next to its closed form."""
    name, p, m = point
    return compare_one(name, p, m, num_stages_per_rank=cfg["num_stages_per_rank"], **cfg["costs"])


def run_bubble_sweep(config_dict: dict, out_dir) -> dict:
    """Run the sweep; write ``bubble_sweep.csv`` and ``bubble_sweep.png`` to ``out_dir``.

    Returns :func:`summarize` of the rows plus the output paths (``csv``, ``plot``).
    """
    cfg = parse_config(config_dict)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [sweep_row(cfg, point) for point in grid(cfg)]
    csv_path = out / "bubble_sweep.csv"
    fields = list(rows[0].as_dict())
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(r.as_dict())
    plot_path = out / "bubble_sweep.png"
    figure(rows, cfg).savefig(plot_path, dpi=120)
    return {**summarize(rows, cfg), "csv": str(csv_path), "plot": str(plot_path)}


def summarize(rows, cfg) -> dict:
    """Row counts, how many rows the closed form matched / did not apply / mismatched, the
    largest |simulated - formula| where it applies, the best schedule per P at the largest m
    and a one-line ``headline``."""
    ran = [r for r in rows if not r.note]
    applies = [r for r in ran if r.formula_applies]
    errors = [abs(r.sim_bubble - r.formula_bubble) for r in applies]
    mismatched = [r for r in applies if not math.isclose(r.sim_bubble, r.formula_bubble, abs_tol=1e-9)]
    best = {}
    k_max = max(cfg["multipliers"])
    for p in cfg["num_stages"]:
        cands = [r for r in ran if r.P == p and r.microbatches == k_max * p]
        if cands:
            b = min(cands, key=lambda r: r.bubble_ratio)
            best[p] = {"schedule": b.schedule, "bubble_ratio": b.bubble_ratio}
    p_mid = sorted(cfg["num_stages"])[len(cfg["num_stages"]) // 2]
    parts = [f"{r.schedule} {100 * r.bubble_ratio:.1f}%" for r in ran if r.P == p_mid and r.microbatches == k_max * p_mid]
    headline = (f"bubble ratio at P={p_mid}, m={k_max * p_mid}: " + ", ".join(parts)
                + f"; formulas exact on {len(applies) - len(mismatched)}/{len(applies)} rows where they apply, "
                f"not applicable on {len(ran) - len(applies)}")
    return {
        "rows": len(rows),
        "simulated": len(ran),
        "skipped": len(rows) - len(ran),
        "formula_applies": len(applies),
        "formula_mismatches": len(mismatched),
        "max_abs_error_where_applies": max(errors, default=0.0),
        "best_at_largest_m": best,
        "headline": headline,
    }


def figure(rows, cfg):
    """Simulated bubble ratio against m, one panel per P (a matplotlib Figure, no pyplot)."""
    from matplotlib.figure import Figure

    stages = cfg["num_stages"]
    fig = Figure(figsize=(4.2 * len(stages), 3.8))
    axes = fig.subplots(1, len(stages), squeeze=False, sharey=True)
    for ax, p in zip(axes[0], stages):
        for name in cfg["schedules"]:
            pts = [(r.microbatches, r.bubble_ratio) for r in rows if r.P == p and r.schedule == name and not r.note]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=name)
        ms = [k * p for k in cfg["multipliers"]]
        ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", lw=0.8, label="(P-1)/(m+P-1)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"P = {p}")
        ax.set_xlabel("micro-batches m")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("simulated bubble ratio")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig
