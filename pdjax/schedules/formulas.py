"""Closed-form bubbles and memory of pipeline schedules, and when they hold.

Costs are times per op of one stage (F forward, B full backward, W its weight-grad part,
I = B - W, FB an overlapped forward+backward pair); ``P`` is the README's ``PP``: the
number of stages in a pipeline (ranks for 1F1B/ZB1P/DualPipe, ``2 x ranks`` for
DualPipeV). Bubbles are per-device idle time in the same unit.

README table (deepseek-ai/DualPipe), exact where :func:`formula_conditions` says so:

| schedule  | bubble                 | params | activations | devices |
|-----------|------------------------|--------|-------------|---------|
| 1F1B      | (P-1)(F+B)             | 1x     | P           | P       |
| ZB1P      | (P-1)(F+B-2W)          | 1x     | P           | P       |
| DualPipe  | (P/2-1)(F&B+B-3W)      | 2x     | P+1         | P       |
| DualPipeV | (P/2-1)(F&B+B-3W)      | 2x     | P+1         | P/2     |

The activations column is the most-loaded rank's peak and equals the simulator's W-aware
count (see :func:`memory_table`): P on rank 0 for 1F1B (P - r on rank r), P on every
rank for ZB1P, P+1 on every rank for DualPipe and DualPipeV.

General DualPipe/DualPipeV makespan, found with the simulator and checked against it
for random costs (exact whenever ``FB >= max(F, B)``, uniform stages, no comm): with
``n = P/2`` and ``H`` micro-batches per phase (``C/2`` for DualPipe, ``C`` for DualPipeV)

    makespan = (2H-n-2)*FB + 2n*F + (2n+1)*I + 3W + max(n*F, (n-1)*I) + (n-1)*max(0, W-I)

and rank ``r`` (``h = min(r, N-1-r)`` for DualPipe, ``h = r`` for DualPipeV) is busy
``(3n-h-1+d)(F+B) + (2H-3n+h+1-d)*FB`` with ``d = 1`` on the middle rank(s) ``h = n-1``
(their first pair is not overlapped). The middle ranks' bubble is therefore

    bubble_mid = (n-1)*(FB - W - min(W, I)) + max((n-1)*F, (n-1)*I - F)

which is the README's (P/2-1)(F&B+B-3W) exactly when F = I >= W.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from pdjax.arguments import check_int

_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev")


def _name(name: str) -> str:
    key = str(name).strip().lower()
    if key not in _NAMES:
        raise ValueError(f"unknown schedule name {name!r}; known: {list(_NAMES)}")
    return key


def bubble_ratio_1f1b(num_stages: int, num_microbatches: int) -> float:
    """1F1B bubble ratio ``(P-1)/(m+P-1)`` (idle share of each device's time)."""
    p = check_int("num_stages", num_stages)
    m = check_int("num_microbatches", num_microbatches)
    return (p - 1) / (m + p - 1)


def min_microbatches_1f1b(num_stages: int, max_ratio: float) -> int:
    """Smallest ``m`` with 1F1B bubble ratio strictly below ``max_ratio`` in (0, 1):
    ``m > (P-1)(1-r)/r`` (``9(P-1)``, i.e. 136 at P = 16, for 10 %). Exact: a float ratio is
    read as its shortest decimal repr (0.1 is one tenth), so the boundary ``m = 9(P-1)`` at
    10 % is excluded exactly, with no float rounding to guard against."""
    p = check_int("num_stages", num_stages)
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float, Fraction)):
        raise ValueError(f"max_ratio must be a number, got {max_ratio!r}")
    r = Fraction(repr(max_ratio)) if isinstance(max_ratio, float) else Fraction(max_ratio)
    if not 0 < r < 1:
        raise ValueError(f"max_ratio must be in (0, 1), got {max_ratio!r}")
    if p == 1:
        return 1  # no pipeline, no bubble
    return max(1, math.floor((p - 1) * (1 - r) / r) + 1)


def bubble_formula(name: str, num_stages: int, F: float = 1.0, B: float = 2.0, W: float = 0.0,
                   FB: float | None = None) -> float:
    """The README's closed-form per-device bubble of schedule ``name`` with ``num_stages``
    (= P) stages. ``FB`` defaults to ``F + B``. For interleaved-1f1b the costs are per
    chunk and the bubble equals 1F1B's; GPipe's equals 1F1B's."""
    key = _name(name)
    p = check_int("num_stages", num_stages)
    fb = F + B if FB is None else FB
    if key in ("gpipe", "1f1b", "interleaved-1f1b"):
        return (p - 1) * (F + B)
    if key == "zb1p":
        return (p - 1) * (F + B - 2 * W)
    if p % 2:
        raise ValueError(f"{key} needs an even number of stages P, got {p}")
    return (p / 2 - 1) * (fb + B - 3 * W)


def formula_conditions(name: str, F=1.0, B=2.0, W=0.0, FB=None, comm=0.0) -> tuple[bool, str]:
    """Whether :func:`bubble_formula` is exact for these costs, and if not, why.

    Conditions were checked against the simulator (tests/pipeline/test_formulas.py).
    Costs given per stage (arrays) must be uniform.
    """
    key = _name(name)
    vals = {}
    for field, v in (("F", F), ("B", B), ("W", W), ("comm", comm)) + ((("FB", FB),) if FB is not None else ()):
        arr = np.atleast_1d(np.asarray(v, dtype=float))
        if arr.size and not np.allclose(arr, arr[0]):
            return False, f"non-uniform per-stage {field}: the formulas assume identical stages"
        vals[field] = float(arr[0])
    f, b, w, c = vals["F"], vals["B"], vals["W"], vals["comm"]
    fb = vals.get("FB", f + b)
    i = b - w
    if c != 0:
        return False, f"comm = {c:g} > 0: the formulas ignore communication latency"
    if key in ("gpipe", "1f1b", "interleaved-1f1b"):
        return True, "exact for uniform stages without comm"
    if key == "zb1p":
        if w <= min(f, i):
            return True, "exact when W <= min(F, I)"
        return False, f"needs W <= min(F, I); got W = {w:g}, F = {f:g}, I = B - W = {i:g}"
    if fb < max(f, b):
        return False, f"needs FB >= max(F, B); got FB = {fb:g}, max(F, B) = {max(f, b):g}"
    if not np.isclose(f, i) or w > i:
        return False, (f"only exact when F = I >= W; got F = {f:g}, I = {i:g}, W = {w:g} "
                       f"(use dualpipe_bubble for the general expression)")
    return True, "exact on the middle ranks when F = I >= W and FB >= max(F, B)"


def _dualpipe_shape(name: str, num_ranks: int, num_microbatches: int) -> tuple[int, int, list[int]]:
    key = _name(name)
    n_ranks = check_int("num_ranks", num_ranks)
    c = check_int("num_microbatches", num_microbatches)
    if key == "dualpipe":
        n, per_phase = n_ranks // 2, c // 2
        halves = [min(r, n_ranks - 1 - r) for r in range(n_ranks)]
    elif key == "dualpipev":
        n, per_phase = n_ranks, c
        halves = list(range(n_ranks))
    else:
        raise ValueError(f"the general expression is for dualpipe/dualpipev, got {name!r}")
    return n, per_phase, halves


def dualpipe_makespan(name: str, num_ranks: int, num_microbatches: int,
                      F=1.0, B=2.0, W=0.0, FB=None) -> float:
    """General DualPipe/DualPipeV makespan (module docstring); exact when FB >= max(F, B)."""
    n, per_phase, _ = _dualpipe_shape(name, num_ranks, num_microbatches)
    fb = F + B if FB is None else FB
    i = B - W
    return ((2 * per_phase - n - 2) * fb + 2 * n * F + (2 * n + 1) * i + 3 * W
            + max(n * F, (n - 1) * i) + (n - 1) * max(0.0, W - i))


def dualpipe_bubble(name: str, num_ranks: int, num_microbatches: int,
                    F=1.0, B=2.0, W=0.0, FB=None) -> np.ndarray:
    """Per-rank bubble of DualPipe/DualPipeV from the general expression (module
    docstring): makespan minus each rank's busy time. Exact when FB >= max(F, B)."""
    n, per_phase, halves = _dualpipe_shape(name, num_ranks, num_microbatches)
    fb = F + B if FB is None else FB
    makespan = dualpipe_makespan(name, num_ranks, num_microbatches, F=F, B=B, W=W, FB=fb)
    out = []
    for h in halves:
        d = 1 if h == n - 1 else 0
        single = 3 * n - h - 1 + d
        pairs = 2 * per_phase - 3 * n + h + 1 - d
        out.append(makespan - single * (F + B) - pairs * fb)
    return np.array(out)


def memory_table(name: str, num_stages: int) -> dict:
    """README memory columns for ``P = num_stages``: parameter copies per device (in
    units of one stage's weights), peak live activations per device (in micro-batch
    activations of one stage), and the number of devices.

    ``activations`` is the most-loaded rank's peak. The faithful simulation (a micro-batch's
    activations live from its F's start until its B ends, or its W ends when the backward
    is split; an overlapped pair holds both parts' units) agrees with the published table
    for every size checked (DualPipe 2-16 ranks, DualPipeV 1-16, micro-batches ``2 x ranks``
    to ``2 x ranks + 23``; any positive costs give the same peaks, since ops on a rank
    never overlap and the peak depends only on each rank's op order), rank by rank:

    - 1F1B: rank ``r`` holds ``P - r`` (``min(P - r, m)``); the column is rank 0's ``P``;
    - ZB1P (ZB-H1): every rank holds ``P`` (``min(P, m)``), as in the zero-bubble paper
      (freeing at the ``I`` instead would undercount to ``P - r``);
    - DualPipe (``P`` = ranks) and DualPipeV (``P`` = 2 x ranks): every rank holds
      ``P + 1``. Only the middle rank(s) (DualPipeV: the last rank), whose first pair is
      not overlapped, reach ``P + 1`` if a pair's backward frees before its forward
      allocates; the other ranks reach it because a pair holds both units.
    """
    key = _name(name)
    p = check_int("num_stages", num_stages)
    if key in ("1f1b", "zb1p"):
        return {"params": 1, "activations": p, "devices": p}
    if key == "dualpipe":
        return {"params": 2, "activations": p + 1, "devices": p}
    if key == "dualpipev":
        if p % 2:
            raise ValueError(f"dualpipev needs an even number of stages P, got {p}")
        return {"params": 2, "activations": p + 1, "devices": p // 2}
    raise ValueError(f"the README memory table covers 1f1b, zb1p, dualpipe, dualpipev; got {name!r}")
