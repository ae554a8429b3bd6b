"""The cost model's calibration results: measured prefill and decode times summarised per
shape, the fits (:mod:`costmodel_fit`) and their held-out errors, and the checks of the
shapes to measure. Pure Python + numpy: the timing of the real model that fills them is
:mod:`pdjax.timing` (``pdjax.timing.calibrate``, ``calibrate_decode``)."""


from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from pdjax.analysis.costmodel_fit import (DecodeCostFit, PrefillCostFit, decode_design_matrix,
                                          fit_decode_cost, fit_prefill_cost, relative_errors)


class _Errors:
    """Prediction errors of a calibration result (``fit``, ``samples``, ``holdout``)."""

    @property
    def holdout_errors(self) -> np.ndarray:
        """Relative prediction errors on the held-out shapes (empty if none)."""
        return relative_errors(self.fit, self.holdout) if self.holdout else np.zeros(0)

    def _errors(self) -> np.ndarray:
        return self.holdout_errors if self.holdout else relative_errors(self.fit, self.samples)

    @property
    def median_error(self) -> float:
        """Median relative error on the held-out shapes (on the training shapes if none)."""
        return float(np.median(self._errors()))

    @property
    def max_error(self) -> float:
        return float(np.max(self._errors()))


@dataclasses.dataclass(frozen=True)
class CalibrationResult(_Errors):
    """Measured prefill times, the fit to the training shapes and its held-out error.

    ``samples`` / ``holdout``: (q, c, seconds), seconds the ``statistic`` ("median" or
    "min") of each shape's repeats; ``repeats``: raw times {(q, c): [seconds, ...]};
    ``fit``: fitted to ``samples`` only."""

    fit: PrefillCostFit
    samples: tuple
    holdout: tuple
    repeats: dict
    backend: str
    statistic: str = "median"

    def refit(self, *, intercept: Optional[bool] = None,
              statistic: Optional[str] = None) -> "CalibrationResult":
        """The same measurements, fitted with or without the constant term and/or
        summarised by another statistic (no new timing)."""
        intercept = self.fit.intercept if intercept is None else intercept
        statistic = self.statistic if statistic is None else _check_statistic(statistic)
        samples, held = _summarise(self.repeats, [s[:2] for s in self.samples],
                                   [s[:2] for s in self.holdout], statistic)
        return dataclasses.replace(self, fit=fit_prefill_cost(samples, intercept=intercept),
                                   samples=samples, holdout=held, statistic=statistic)

    def rows(self) -> list[dict]:
        """One dict per shape: q, c, split ("fit"/"held-out"), measured_s, predicted_s,
        rel_error, spread (max/min of the repeats)."""
        out = []
        for split, samples in (("fit", self.samples), ("held-out", self.holdout)):
            for q, c, t in samples:
                pred = float(self.fit(q, c))
                raw = self.repeats.get((int(q), int(c)), [t])
                out.append(dict(q=int(q), c=int(c), split=split, measured_s=t, predicted_s=pred,
                                rel_error=abs(pred - t) / t, spread=max(raw) / min(raw)))
        return out

    def table(self) -> str:
        return _calibration_table(self, (("q", 6), ("c", 6)))


STATISTICS = {"median": np.median, "min": np.min}


def _check_statistic(statistic: str) -> str:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    return statistic


def _summarise(times: dict, shapes, holdout, statistic: str):
    f = STATISTICS[statistic]
    one = lambda qc: (int(qc[0]), int(qc[1]), float(f(times[(int(qc[0]), int(qc[1]))])))  # noqa: E731
    return tuple(map(one, shapes)), tuple(map(one, holdout))


def check_shapes(name: str, shapes, labels=("q", "c"), lows=(1, 0)) -> list[tuple[int, int]]:
    out = []
    for item in shapes:
        try:
            q, c = (int(v) for v in item)
            ok = all(int(v) == v for v in item)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{name} must hold integer ({labels[0]}, {labels[1]}) pairs, "
                             f"got {item!r}")
        if q < lows[0] or c < lows[1]:
            raise ValueError(f"{name}: need {labels[0]} >= {lows[0]} and {labels[1]} >= "
                             f"{lows[1]}, got {(q, c)}")
        out.append((q, c))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} has duplicate shapes: {out}")
    return out


# ---- decode steps -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DecodeCalibrationResult(_Errors):
    """Measured decode-step times, the fit t(B, K) = d0 + d1 B + d2 K to the training shapes
    and its held-out error.

    ``samples`` / ``holdout``: (B, K, seconds) with K = B * L the cached tokens of the
    batch; ``repeats``: raw times {(B, L): [seconds, ...]} keyed by the measured shape
    (B requests of L cached tokens each); ``fit``: fitted to ``samples`` only."""

    fit: DecodeCostFit
    samples: tuple
    holdout: tuple
    repeats: dict
    backend: str
    statistic: str = "median"

    def refit(self, *, statistic: Optional[str] = None) -> "DecodeCalibrationResult":
        """The same measurements summarised by another statistic and refitted."""
        statistic = self.statistic if statistic is None else _check_statistic(statistic)
        samples, held = _summarise_decode(self.repeats, _decode_shapes(self.samples),
                                          _decode_shapes(self.holdout), statistic)
        return dataclasses.replace(self, fit=fit_decode_cost(samples), samples=samples,
                                   holdout=held, statistic=statistic)

    def rows(self) -> list[dict]:
        """One dict per shape: B, L (cached tokens per request), K = B L, split,
        measured_s, predicted_s, rel_error, spread (max/min of the repeats)."""
        out = []
        for split, samples in (("fit", self.samples), ("held-out", self.holdout)):
            for (B, L), (_, K, t) in zip(_decode_shapes(samples), samples):
                pred = float(self.fit(B, K))
                raw = self.repeats.get((B, L), [t])
                out.append(dict(B=B, L=L, K=int(K), split=split, measured_s=t, predicted_s=pred,
                                rel_error=abs(pred - t) / t, spread=max(raw) / min(raw)))
        return out

    def table(self) -> str:
        return _calibration_table(self, (("B", 4), ("L", 6), ("K", 7)))


def _calibration_table(result, keys) -> str:
    """Measured vs predicted per shape (``keys``: (column, width) of the shape columns),
    the fit and the error summary; shared by the prefill and decode results."""
    head = " ".join(f"{k:>{w}}" for k, w in keys)
    lines = [f"{head} {'split':>9} {'measured ms':>12} {'predicted ms':>13} {'rel err':>8} {'max/min':>8}"]
    for r in result.rows():
        cells = " ".join(f"{r[k]:>{w}}" for k, w in keys)
        lines.append(f"{cells} {r['split']:>9} {r['measured_s'] * 1e3:>12.2f} {r['predicted_s'] * 1e3:>13.2f} "
                     f"{r['rel_error'] * 100:>7.1f}% {r['spread']:>8.2f}")
    where = "held-out" if result.holdout else "training (no held-out shapes)"
    lines.append(f"{result.fit}")
    lines.append(f"{where} relative error: median {result.median_error * 100:.1f} %, "
                 f"max {result.max_error * 100:.1f} %  [{result.statistic} of "
                 f"{min(len(v) for v in result.repeats.values())} repeats, backend {result.backend}]")
    return "\n".join(lines)


def _decode_shapes(samples) -> list[tuple[int, int]]:
    """(B, K, seconds) samples -> the measured (B, L) shapes (K = B L)."""
    return [(int(B), int(K) // int(B)) for B, K, _ in samples]


def _summarise_decode(times: dict, shapes, holdout, statistic: str):
    f = STATISTICS[statistic]
    one = lambda bl: (bl[0], bl[0] * bl[1], float(f(times[bl])))  # noqa: E731
    return tuple(map(one, shapes)), tuple(map(one, holdout))


def check_decode_shapes(name: str, shapes, cfg) -> list[tuple[int, int]]:
    out = check_shapes(name, shapes, labels=("B", "L"), lows=(1, 1))
    for B, L in out:
        if L + 1 > cfg.max_position_embeddings:
            raise ValueError(f"{name}: shape (B={B}, L={L}) needs a cache of L + 1 = {L + 1} "
                             f"positions, over max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    return out


def prefill_result(times: dict, shapes, holdout, *, intercept: bool, statistic: str,
                   backend: str) -> CalibrationResult:
    """The result of measured prefill ``times`` {(q, c): [seconds]}: fitted to ``shapes``,
    ``holdout`` only predicted."""
    samples, held = _summarise(times, shapes, holdout, statistic)
    return CalibrationResult(fit=fit_prefill_cost(samples, intercept=intercept), samples=samples,
                             holdout=held, repeats=times, backend=backend, statistic=statistic)


def check_prefill_plan(shapes, holdout, intercept: bool, statistic: str):
    """(shapes, holdout) checked for a prefill calibration: integer (q, c) pairs, disjoint,
    enough fitting shapes for the model (3, 4 with the intercept)."""
    _check_statistic(statistic)
    shapes = check_shapes("shapes", shapes)
    holdout = check_shapes("holdout", holdout)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    need = 4 if intercept else 3
    if len(shapes) < need:
        raise ValueError(f"calibrate needs at least {need} fitting shapes, got {len(shapes)}")
    return shapes, holdout


def decode_result(times: dict, shapes, holdout, *, statistic: str, backend: str) -> DecodeCalibrationResult:
    """The result of measured decode ``times`` {(B, L): [seconds]}: t(B, K) fitted to
    ``shapes``, ``holdout`` only predicted."""
    samples, held = _summarise_decode(times, shapes, holdout, statistic)
    return DecodeCalibrationResult(fit=fit_decode_cost(samples), samples=samples, holdout=held,
                                   repeats=times, backend=backend, statistic=statistic)


def check_decode_plan(shapes, holdout, cfg, statistic: str):
    """(shapes, holdout) checked for a decode calibration: (B, L) pairs that fit the context,
    disjoint, at least 3 fitting shapes that separate d0, d1 and d2."""
    _check_statistic(statistic)
    shapes = check_decode_shapes("shapes", shapes, cfg)
    holdout = check_decode_shapes("holdout", holdout, cfg)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    if len(shapes) < 3:
        raise ValueError(f"calibrate_decode needs at least 3 fitting shapes, got {len(shapes)}")
    Bs = np.array([B for B, _ in shapes], np.float64)
    Ks = np.array([B * L for B, L in shapes], np.float64)
    if np.linalg.matrix_rank(decode_design_matrix(Bs, Ks)) < 3:
        raise ValueError("calibrate_decode: the fitting shapes do not separate d0, d1 and d2 "
                         "(vary B and K = B L independently, e.g. two B at two L)")
    return shapes, holdout
