"""Pipeline bubble arithmetic of the 1F1B schedule.

With P stages and m micro-batches of equal cost, 1F1B idles each stage for (P - 1) slots
out of (m + P - 1): rho = (P - 1) / (m + P - 1). Keeping rho below a target r needs
m > (P - 1)(1 - r) / r; for r = 10 %: m > 9 (P - 1), i.e. m >= 136 at P = 16.

The formulas are :mod:`pdjax.schedules.formulas`' (one of each, with the closed forms of
ZB1P / DualPipe / DualPipeV, whose simulator is the reference); this module tabulates them.
"""

from __future__ import annotations

from pdjax.schedules.formulas import bubble_ratio_1f1b, min_microbatches_1f1b  # noqa: F401 (re-exported)


def bubble_table(num_stages: int, microbatches) -> dict:
    """``{m: bubble_ratio_1f1b(P, m)}`` for each m in ``microbatches``."""
    return {int(m): bubble_ratio_1f1b(num_stages, m) for m in microbatches}
