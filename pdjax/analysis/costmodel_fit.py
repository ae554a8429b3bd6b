"""The fitted prefill cost cost(q, c) = a q^2 + b q c + g q (+ d), and its inverse.

q is the number of new tokens in a chunk, c the cached prefix it attends to, cost in
seconds. The three terms are the causal attention within the chunk (q^2), attention to the
prefix (q c) and everything linear in tokens (projections, MLP, experts: q). The optional
constant ``d`` (``intercept=True``) absorbs a fixed per-call cost (dispatch, kernel
launches, a weight read that does not grow with q); it is off by default, as in the
three-term model of the source articles (DeepSeek's prefill scheduler).

Least squares with non-negative coefficients (NNLS), so that the cost is monotone in q
and c: with at most four unknowns the exact NNLS optimum is found by solving the
unconstrained least-squares problem on every subset of the columns and keeping the best
subset whose solution is non-negative (the optimum's support is one of them: on its
support it is the unconstrained solution). Columns are scaled to unit norm before
solving, so noise-free samples are recovered to ~1e-12 relative.

The decode step has its own model, t(B, K) = d0 + d1 B + d2 K (B requests, K cached
tokens summed over them), fitted by the same NNLS (:func:`fit_decode_cost`); an engine's
decode loop adds per-request handoff work between steps, dj per request joining the batch
and dl per request leaving it (``fit_decode_cost(..., handoff=True)``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

import numpy as np

from pdjax.arguments import check_int, check_positive


@dataclasses.dataclass(frozen=True)
class PrefillCostFit:
    """cost(q, c) = a q^2 + b q c + g q + d seconds; ``r2`` the coefficient of
    determination on the ``n`` samples it was fitted to (1 - SS_res / SS_tot)."""

    a: float
    b: float
    g: float
    r2: float
    n: int
    d: float = 0.0

    def __call__(self, q, c):
        """Predicted seconds of a chunk of ``q`` new tokens over ``c`` cached ones
        (scalars or numpy arrays)."""
        return self.a * q * q + self.b * q * c + self.g * q + self.d

    @property
    def intercept(self) -> bool:
        return self.d != 0.0

    def max_chunk(self, c: int, budget_s: float, q_max: Optional[int] = None,
                  align: int = 1) -> int:
        """The largest q with cost(q, c) <= ``budget_s``, capped at ``q_max`` and rounded
        down to a multiple of ``align`` (a hardware tile, e.g. 128 or 256); 0 if not even
        ``align`` tokens fit.

        Closed form (positive root of a q^2 + (b c + g) q + d - budget = 0), then checked
        and adjusted by whole tokens so that cost(q) <= budget < cost(q + 1). A cost that
        does not grow with q (a = b c + g = 0) fits any q: ``q_max`` is then required."""
        c = check_int("c", c, 0)
        check_positive("budget_s", budget_s)
        align = check_int("align", align, 1)
        if q_max is not None:
            q_max = check_int("q_max", q_max, 1)
        lin = self.b * c + self.g
        room = budget_s - self.d
        if self.a == 0 and lin == 0:
            if q_max is None:
                raise ValueError("the fitted cost does not grow with q (a = b c + g = 0): "
                                 "every chunk fits, pass q_max")
            q = q_max if room >= 0 else 0
        elif room < 0:
            q = 0
        else:
            # stable positive root of a q^2 + lin q - room = 0
            q = int(math.floor(2 * room / (lin + math.sqrt(lin * lin + 4 * self.a * room))))
            while q > 0 and self(q, c) > budget_s:
                q -= 1
            while self(q + 1, c) <= budget_s and (q_max is None or q < q_max):
                q += 1
        if q_max is not None:
            q = min(q, q_max)
        return (q // align) * align

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        s = f"cost(q, c) = {self.a:.4g} q^2 + {self.b:.4g} q c + {self.g:.4g} q"
        if self.d:
            s += f" + {self.d:.4g}"
        return f"{s} s  (R^2 = {self.r2:.4f}, n = {self.n})"


def _as_samples(samples, names: tuple[str, str] = ("q", "c")) -> np.ndarray:
    """(x, y, seconds) triples -> float64 array [n, 3], finite and >= 0 (``names``: what
    x and y are called in the error messages)."""
    what = f"({names[0]}, {names[1]}, seconds) triples"
    try:
        arr = np.asarray([tuple(s) for s in samples], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"samples must be a sequence of {what}") from None
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"samples must be {what}, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = arr[~np.all(np.isfinite(arr), axis=1)][0]
        raise ValueError(f"samples must be finite, got {tuple(bad)}")
    for col, name in ((0, names[0]), (1, names[1]), (2, "seconds")):
        if np.any(arr[:, col] < 0):
            raise ValueError(f"sample {name} must be >= 0, got {arr[arr[:, col] < 0, col][0]!r}")
    return arr


def design_matrix(q, c, intercept: bool = False) -> np.ndarray:
    """Columns [q^2, q c, q (, 1)] of the prefill cost model."""
    q = np.asarray(q, np.float64)
    c = np.asarray(c, np.float64)
    cols = [q * q, q * c, q] + ([np.ones_like(q)] if intercept else [])
    return np.stack(cols, axis=1)


def nnls_small(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a few columns (enumerates supports)."""
    n_cols = X.shape[1]
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    best, best_res = np.zeros(n_cols), float(np.sum(y * y))   # the empty support
    for size in range(n_cols, 0, -1):          # largest supports first: ties keep them
        for support in itertools.combinations(range(n_cols), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((Xs[:, cols] @ sol - y) ** 2))
            if res < best_res * (1 - 1e-12) or not best.any():
                best = np.zeros(n_cols)
                best[cols] = sol
                best_res = res
    return best / scale


def r_squared(y: np.ndarray, pred: np.ndarray) -> float:
    """1 - SS_res / SS_tot (SS_tot about the mean); 1.0 when the samples are all equal
    and predicted exactly."""
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    if ss_tot == 0:
        return 1.0 if ss_res == 0 else 0.0
    return 1.0 - ss_res / ss_tot


def fit_prefill_cost(samples: Sequence[tuple[float, float, float]], *,
                     intercept: bool = False) -> PrefillCostFit:
    """Fit cost(q, c) = a q^2 + b q c + g q (+ d with ``intercept=True``) to measured
    ``samples`` [(q, c, seconds), ...] by non-negative least squares; returns a
    :class:`PrefillCostFit` with R^2 on the samples.

    ValueError: fewer than 3 samples (4 with the intercept), non-finite or negative values,
    or no sample with q > 0."""
    arr = _as_samples(samples)
    need = 4 if intercept else 3
    if len(arr) < need:
        raise ValueError(f"fit_prefill_cost needs at least {need} samples, got {len(arr)}")
    q, c, y = arr[:, 0], arr[:, 1], arr[:, 2]
    if not np.any(q > 0):
        raise ValueError("fit_prefill_cost needs samples with q > 0")
    X = design_matrix(q, c, intercept)
    coef = nnls_small(X, y)
    r2 = r_squared(y, X @ coef)
    a, b, g = (float(v) for v in coef[:3])
    d = float(coef[3]) if intercept else 0.0
    return PrefillCostFit(a=a, b=b, g=g, r2=r2, n=len(arr), d=d)


def relative_errors(fit, samples) -> np.ndarray:
    """|predicted - measured| / measured for each sample: (q, c, seconds) for a
    :class:`PrefillCostFit`, (B, K, seconds) for a :class:`DecodeCostFit`."""
    arr = _as_samples(samples, ("B", "K") if isinstance(fit, DecodeCostFit) else ("q", "c"))
    if np.any(arr[:, 2] <= 0):
        raise ValueError("relative errors need measured seconds > 0")
    return np.abs(fit(arr[:, 0], arr[:, 1]) - arr[:, 2]) / arr[:, 2]


# ---- decode step: t(B, K) = d0 + d1 B + d2 K ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DecodeCostFit:
    """t(B, K) = d0 + d1 B + d2 K seconds for one decode step of B requests holding K cached
    tokens in total (summed over the batch); ``r2`` on the ``n`` samples it was fitted to.

    d0 is the per-step cost that does not grow with the batch (the weight read of a
    memory-bound step, dispatch), d1 the per-request cost (activations, expert rows,
    the lm_head row), d2 the per-cached-token cost (reading the latent KV in attention).
    ``dj`` / ``dl``: seconds an engine's decode loop adds to a step per request joining the
    batch (writing its KV into the blocks, admitting it) / leaving it (freeing its blocks);
    0 unless fitted with ``handoff=True`` (see :meth:`overhead`)."""

    d0: float
    d1: float
    d2: float
    r2: float
    n: int
    dj: float = 0.0
    dl: float = 0.0

    def __call__(self, B, K):
        """Predicted seconds of a step of ``B`` requests over ``K`` cached tokens in total
        (scalars or numpy arrays)."""
        return self.d0 + self.d1 * B + self.d2 * K

    def overhead(self, joined, left):
        """Seconds of handoff work in the loop iteration of a step that ``joined`` requests
        joined and after ``left`` requests left: dj * joined + dl * left."""
        return self.dj * joined + self.dl * left

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        s = f"t(B, K) = {self.d0:.4g} + {self.d1:.4g} B + {self.d2:.4g} K"
        if self.dj or self.dl:
            s += f" + {self.dj:.4g} joined + {self.dl:.4g} left"
        return f"{s} s  (R^2 = {self.r2:.4f}, n = {self.n})"


def decode_design_matrix(B, K) -> np.ndarray:
    """Columns [1, B, K] of the decode step model."""
    B = np.asarray(B, np.float64)
    K = np.asarray(K, np.float64)
    return np.stack([np.ones_like(B), B, K], axis=1)


def fit_decode_cost(samples: Sequence[tuple], *, handoff: bool = False) -> DecodeCostFit:
    """Fit t(B, K) = d0 + d1 B + d2 K to measured decode steps ``samples``
    [(B, K, seconds), ...] (B requests, K cached tokens summed over them) by non-negative
    least squares (the exact NNLS of :func:`nnls_small`, as for the prefill); returns a
    :class:`DecodeCostFit` with R^2 on the samples.

    ``handoff=True``: samples are decode-loop iterations (B, K, joined, left, seconds) and
    the fit adds dj * joined + dl * left (requests that joined the step / left before it).

    ValueError: too few samples (3, or 5 with ``handoff``), non-finite or negative values,
    or B < 1 (a decode step serves at least one request)."""
    if not handoff:
        arr = _as_samples(samples, ("B", "K"))
    else:
        try:
            arr = np.asarray([tuple(s) for s in samples], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError("samples must be (B, K, joined, left, seconds) tuples") from None
        if arr.ndim != 2 or arr.shape[1] != 5:
            raise ValueError(f"samples must be (B, K, joined, left, seconds) tuples, got shape {arr.shape}")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError("samples must be finite and >= 0")
        arr = arr[:, [0, 1, 4, 2, 3]]               # (B, K, seconds, joined, left)
    need = 5 if handoff else 3
    if len(arr) < need:
        raise ValueError(f"fit_decode_cost needs at least {need} samples, got {len(arr)}")
    B, K, y = arr[:, 0], arr[:, 1], arr[:, 2]
    if np.any(B < 1):
        raise ValueError(f"sample B must be >= 1 (requests in the step), got {B[B < 1][0]!r}")
    X = decode_design_matrix(B, K)
    if handoff:
        X = np.concatenate([X, arr[:, 3:5]], axis=1)
    coef = nnls_small(X, y)
    d0, d1, d2 = (float(v) for v in coef[:3])
    dj, dl = (float(v) for v in coef[3:5]) if handoff else (0.0, 0.0)
    return DecodeCostFit(d0=d0, d1=d1, d2=d2, r2=r_squared(y, X @ coef), n=len(arr), dj=dj, dl=dl)
