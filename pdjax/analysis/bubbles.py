"""Pipeline bubble arithmetic of the 1F1B schedule.

With P stages and m micro-batches of equal cost, 1F1B idles each stage for (P - 1) slots
out of (m + P - 1): rho = (P - 1) / (m + P - 1). Keeping rho below a target r needs
m > (P - 1)(1 - r) / r; for r = 10 %: m > 9 (P - 1), i.e. m >= 136 at P = 16.

The closed forms of ZB1P / DualPipe / DualPipeV bubbles belong to ``pdjax.pipeline``,
whose simulator is the reference; this module only carries the 1F1B ratio.
"""

from __future__ import annotations

import math
from fractions import Fraction

from pdjax.analysis.units import check_positive_int


def bubble_ratio_1f1b(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a 1F1B pipeline: (P - 1) / (m + P - 1)."""
    p = check_positive_int("num_stages", num_stages)
    m = check_positive_int("num_microbatches", num_microbatches)
    return (p - 1) / (m + p - 1)


def microbatches_for_bubble(num_stages: int, target_ratio: float) -> int:
    """Smallest m with bubble_ratio_1f1b(P, m) < ``target_ratio`` (strictly below).

    ``target_ratio`` in (0, 1); a float is read as its shortest decimal repr (0.1 is
    exactly one tenth), so the boundary m = 9 (P - 1) at 10 % is excluded exactly."""
    p = check_positive_int("num_stages", num_stages)
    if isinstance(target_ratio, bool) or not isinstance(target_ratio, (int, float, Fraction)):
        raise ValueError(f"target_ratio must be a number, got {target_ratio!r}")
    r = Fraction(repr(target_ratio)) if isinstance(target_ratio, float) else Fraction(target_ratio)
    if not 0 < r < 1:
        raise ValueError(f"target_ratio must lie in (0, 1), got {target_ratio!r}")
    if p == 1:
        return 1  # no pipeline, no bubble
    # rho < r  <=>  m > (P - 1)(1 - r) / r
    bound = (p - 1) * (1 - r) / r
    return max(1, math.floor(bound) + 1)


def bubble_table(num_stages: int, microbatches) -> dict:
    """``{m: bubble_ratio_1f1b(P, m)}`` for each m in ``microbatches``."""
    return {int(m): bubble_ratio_1f1b(num_stages, m) for m in microbatches}
