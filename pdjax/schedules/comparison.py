"""Simulated vs closed-form bubbles, side by side, saying when a formula does not apply.

``P`` is the README's stage count: ranks for every schedule except DualPipeV, which runs
``P`` stages on ``P/2`` ranks. Interleaved 1F1B uses ``P`` ranks (costs per chunk).
The simulated bubble compared with the formula is taken on the rank the formula is
about: the middle rank(s) for DualPipe/DualPipeV (where the first pair is not
overlapped), the largest per-rank bubble otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .formulas import (bubble_formula, bubble_ratio_1f1b, dualpipe_bubble, formula_conditions,
                       memory_table)
from .generators import build
from .simulate import simulate


@dataclass(frozen=True)
class ReportRow:
    """One schedule at one size. Times in the simulator's unit; NaN where not run."""

    schedule: str
    P: int
    ranks: int
    microbatches: int
    makespan: float
    sim_bubble: float
    sim_bubble_min: float
    sim_bubble_max: float
    formula_bubble: float
    formula_applies: bool
    formula_note: str
    general_bubble: float
    bubble_ratio: float
    ratio_formula: float
    peak_activations: int
    table_activations: int
    param_copies: int
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def ranks_for(name: str, num_stages: int) -> int:
    """Ranks that run ``num_stages`` (= P) stages: P/2 for DualPipeV, P otherwise."""
    if name == "dualpipev":
        if num_stages % 2:
            raise ValueError(f"dualpipev needs an even number of stages P, got {num_stages}")
        return num_stages // 2
    return num_stages


def compare_one(name: str, num_stages: int, num_microbatches: int, F=1.0, B=2.0, W=1.0, FB=None,
                comm=0.0, num_stages_per_rank: int = 2) -> ReportRow:
    """Simulate ``name`` at ``P = num_stages`` and put it next to its closed form."""
    nan = math.nan
    opts = {"num_stages_per_rank": num_stages_per_rank} if name == "interleaved-1f1b" else {}
    try:
        ranks = ranks_for(name, num_stages)
        schedule = build(name, ranks, num_microbatches, **opts)
    except ValueError as err:
        return ReportRow(name, num_stages, num_stages, num_microbatches, nan, nan, nan, nan, nan, False,
                         "not run", nan, nan, nan, 0, 0, 0, note=f"not applicable: {err}")
    t = simulate(schedule, F=F, B=B, W=W, FB=FB, comm=comm, check=False)
    applies, why = formula_conditions(name, F=F, B=B, W=W, FB=FB, comm=comm)
    scalar = all(_is_scalar(x) for x in (F, B, W, comm) + ((FB,) if FB is not None else ()))
    formula = bubble_formula(name, num_stages, F=_first(F), B=_first(B), W=_first(W),
                             FB=None if FB is None else _first(FB))
    general = nan
    if name in ("dualpipe", "dualpipev"):
        ref_rank = ranks // 2 - 1 if name == "dualpipe" else ranks - 1
        sim_b = float(t.bubble[ref_rank])
        fb = _first(F) + _first(B) if FB is None else _first(FB)
        if scalar and comm == 0 and fb >= max(_first(F), _first(B)):
            general = float(dualpipe_bubble(name, ranks, num_microbatches, F=F, B=B, W=W, FB=fb)[ref_rank])
    else:
        sim_b = float(t.bubble.max())
    if name in ("gpipe", "1f1b"):
        ratio_f = bubble_ratio_1f1b(num_stages, num_microbatches)
    elif name == "interleaved-1f1b":
        ratio_f = formula / (formula + num_microbatches * (_first(F) + _first(B)))
    else:
        ratio_f = nan
    try:
        table_act = memory_table(name, num_stages)["activations"]
    except ValueError:
        table_act = 0
    return ReportRow(name, num_stages, ranks, num_microbatches, t.makespan, sim_b, float(t.bubble.min()),
                     float(t.bubble.max()), formula, applies, why, general, t.bubble_ratio, ratio_f,
                     int(t.peak_activations.max()), table_act, max(schedule.param_copies()))


def _is_scalar(x) -> bool:
    return not hasattr(x, "__len__")


def _first(x) -> float:
    return float(x if _is_scalar(x) else x[0])


def compare(names, num_stages, num_microbatches, **costs) -> list[ReportRow]:
    """Rows for every name x P x m (``num_stages`` and ``num_microbatches`` may be ints
    or lists; a callable ``num_microbatches(P)`` gives per-P lists)."""
    names = [names] if isinstance(names, str) else list(names)
    stages = [num_stages] if isinstance(num_stages, int) else list(num_stages)
    rows = []
    for p in stages:
        mbs = num_microbatches(p) if callable(num_microbatches) else num_microbatches
        mbs = [mbs] if isinstance(mbs, int) else list(mbs)
        for name in names:
            for m in mbs:
                rows.append(compare_one(name, p, m, **costs))
    return rows


def format_report(rows) -> str:
    """A fixed-width text table of :class:`ReportRow` s."""
    head = (f"{'schedule':<17}{'P':>4}{'ranks':>6}{'m':>5}{'makespan':>10}{'sim bubble':>11}"
            f"{'formula':>9}{'general':>9}{'ratio':>7}{'act':>5}  formula")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.note:
            lines.append(f"{r.schedule:<17}{r.P:>4}{r.ranks:>6}{r.microbatches:>5}  {r.note}")
            continue
        gen = "" if math.isnan(r.general_bubble) else f"{r.general_bubble:.3g}"
        status = "exact" if r.formula_applies and math.isclose(r.sim_bubble, r.formula_bubble, abs_tol=1e-9) \
            else ("MISMATCH" if r.formula_applies else "n/a: " + r.formula_note)
        lines.append(f"{r.schedule:<17}{r.P:>4}{r.ranks:>6}{r.microbatches:>5}{r.makespan:>10.4g}"
                     f"{r.sim_bubble:>11.4g}{r.formula_bubble:>9.4g}{gen:>9}{r.bubble_ratio:>7.3f}"
                     f"{r.peak_activations:>5}  {status}")
    return "\n".join(lines) + "\n"
