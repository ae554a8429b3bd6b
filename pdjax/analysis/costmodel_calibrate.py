"""The cost model's calibration, one path for every caller: time each sample shape through a
callback, take the median (or min) of its repeats, fit :mod:`costmodel_fit`'s prefill or
decode cost and report the held-out errors (:func:`calibrate_cost`). Pure Python + numpy:
the callbacks that time the real thing live where it lives (``pdjax.timing.calibrate`` /
``calibrate_decode`` the model, ``PDEngine.calibrate_prefill`` an engine's prefill pool,
``pdjax.experiments.sim_vs_engine`` an engine's decode loop and its prefill as served).

A callback ``measure(shape)`` returns the seconds of one timed call of ``shape`` (timing only
what it means to: preparing its inputs stays outside), a list of seconds (several
observations of it in one call, e.g. a served run's probes), or a dict {sample: seconds or
[seconds]} when one call observes other samples (a served run's decode-loop iterations).
A sample is a key of the fit (:class:`FitSpec`): (q, c) for the prefill, (B, L) for decode
steps (K = B L), (B, K, joined, left) for decode-loop iterations (``handoff``)."""


from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np

from pdjax.analysis.costmodel_fit import (DecodeCostFit, PrefillCostFit, decode_design_matrix,
                                          fit_decode_cost, fit_prefill_cost)
from pdjax.arguments import check_int

STATISTICS = {"median": np.median, "min": np.min}


def _check_statistic(statistic: str) -> str:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    return statistic


@dataclasses.dataclass(frozen=True)
class FitSpec:
    """The fit of a calibration: ``kind`` "prefill", cost(q, c) = a q^2 + b q c + g q (+ d
    with ``intercept``), samples keyed (q, c); or "decode", t(B, K) = d0 + d1 B + d2 K, keyed
    (B, L) with K = B L, or with ``handoff`` (+ dj joined + dl left) keyed (B, K, joined, left)."""

    kind: str = "prefill"
    intercept: bool = False
    handoff: bool = False

    def __post_init__(self):
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"fit kind must be 'prefill' or 'decode', got {self.kind!r}")
        if self.intercept and self.kind != "prefill" or self.handoff and self.kind != "decode":
            raise ValueError("intercept is a prefill option, handoff a decode option")

    @property
    def need(self) -> int:
        """Fewest fitting samples the fit takes."""
        return 4 if self.intercept else 5 if self.handoff else 3

    def sample(self, key: tuple, seconds: float) -> tuple:
        """The fit's sample of a key: (q, c, s), (B, B L, s) or (B, K, joined, left, s)."""
        if self.kind == "decode" and not self.handoff:
            return (key[0], key[0] * key[1], seconds)
        return (*key, seconds)

    def key(self, sample: tuple) -> tuple:
        """The key a sample was measured as (inverse of :meth:`sample`)."""
        if self.kind == "decode" and not self.handoff:
            return (int(sample[0]), int(sample[1]) // int(sample[0]))
        return tuple(sample[:-1])

    def labels(self, key: tuple) -> dict:
        """The key's columns of a result row: q, c / B, L, K / B, K, joined, left."""
        if self.kind == "prefill":
            return dict(q=int(key[0]), c=int(key[1]))
        if not self.handoff:
            return dict(B=key[0], L=key[1], K=int(key[0] * key[1]))
        return dict(zip(("B", "K", "joined", "left"), key))

    def fit(self, samples):
        if self.kind == "prefill":
            return fit_prefill_cost(samples, intercept=self.intercept)
        return fit_decode_cost(samples, handoff=self.handoff)

    def predict(self, fit, sample: tuple) -> float:
        """Predicted seconds of a sample (with the handoff terms where fitted)."""
        t = float(fit(sample[0], sample[1]))
        return t + float(fit.overhead(sample[2], sample[3])) if self.handoff else t


# ---- the one path: time, summarise, fit, hold out ----------------------------------------------

def _observe(measure: Callable, shape, round_: int) -> dict:
    """{sample key: [seconds]} of one ``measure(shape)`` call, checked; a failure names the shape."""
    try:
        out = measure(shape)
    except Exception as e:
        raise RuntimeError(f"calibration: timing sample {shape!r} failed in round {round_}: "
                           f"{type(e).__name__}: {e}") from e
    obs = out if isinstance(out, dict) else {shape: out}
    checked = {}
    for key, secs in obs.items():
        secs = [secs] if np.ndim(secs) == 0 else list(secs)
        for s in secs:
            if isinstance(s, bool) or not isinstance(s, (int, float, np.number)) or not math.isfinite(s) or s <= 0:
                raise ValueError(f"calibration: timing sample {shape!r} gave {s!r} seconds for {key!r}; "
                                 f"need finite seconds > 0")
        checked[key] = [float(s) for s in secs]
    return checked


def time_shapes(measure: Callable, shapes: Sequence, repeats: int = 5, *, warmup: int = 0,
                seed: int = 0) -> tuple[dict, dict]:
    """Call ``measure`` on each distinct shape of ``shapes``: ``warmup`` rounds whose
    observations are dropped (compilation, warm-up), then ``repeats`` rounds, each over the
    shapes in a new shuffled order (a burst of load from other processes spreads over all
    shapes instead of biasing one). Returns ({sample key: [seconds]}, {shape: [the sample
    keys its calls observed]}), both in the order of ``shapes``."""
    check_int("repeats", repeats)
    check_int("warmup", warmup, 0)
    distinct = list(dict.fromkeys(shapes))
    rng = np.random.default_rng(seed)
    times, found = {}, {s: [] for s in distinct}
    for r in range(warmup + repeats):
        for i in rng.permutation(len(distinct)):
            obs = _observe(measure, distinct[i], r)
            if r < warmup:
                continue
            for key, secs in obs.items():
                times.setdefault(key, []).extend(secs)
                if key not in found[distinct[i]]:
                    found[distinct[i]].append(key)
    order = dict.fromkeys(k for s in distinct for k in found[s])
    return {k: times[k] for k in order}, found


def calibrate_cost(measure: Callable, shapes: Sequence, repeats: int = 5, *, fit: FitSpec = FitSpec(),
                   holdout: Sequence = (), statistic: str = "median", warmup: int = 0, seed: int = 0,
                   backend: str = ""):
    """Time ``shapes`` and ``holdout`` with ``measure`` (see the module docstring) in the same
    interleaved rounds (:func:`time_shapes`), fit ``fit`` to the ``statistic`` ("median" or
    "min") of each sample fitted (the samples ``shapes`` observed; a shape listed twice is
    timed once and fitted twice) and predict the held-out ones. Returns a
    :class:`CalibrationResult` (prefill) or :class:`DecodeCalibrationResult` (decode)."""
    _check_statistic(statistic)
    shapes, holdout = list(shapes), list(holdout)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    times, found = time_shapes(measure, shapes + holdout, repeats, warmup=warmup, seed=seed)
    return calibration_result(times, [k for s in shapes for k in found[s]],
                              [k for s in holdout for k in found[s]], fit, statistic, backend)


def calibration_result(times: dict, keys: Sequence, held: Sequence, spec: FitSpec, statistic: str,
                       backend: str = ""):
    """The result of measured ``times`` {sample key: [seconds]}: ``spec`` fitted to the
    ``statistic`` of each of ``keys``, the ``held`` keys only predicted."""
    f = STATISTICS[_check_statistic(statistic)]
    samples = tuple(spec.sample(k, float(f(times[k]))) for k in keys)
    holdout = tuple(spec.sample(k, float(f(times[k]))) for k in held)
    if len(samples) < spec.need:
        raise ValueError(f"calibration found {len(samples)} fitting samples; the {spec.kind} fit needs at "
                         f"least {spec.need}")
    cls = CalibrationResult if spec.kind == "prefill" else DecodeCalibrationResult
    return cls(fit=spec.fit(samples), samples=samples, holdout=holdout, repeats=times, backend=backend,
               statistic=statistic, spec=spec)


# ---- the results --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Calibration:
    """Measured times, the fit to the training samples and its held-out error."""

    fit: object
    samples: tuple
    holdout: tuple
    repeats: dict
    backend: str
    statistic: str = "median"
    spec: FitSpec = FitSpec()

    def _relative(self, samples) -> np.ndarray:
        return np.array([abs(self.spec.predict(self.fit, s) - s[-1]) / s[-1] for s in samples])

    @property
    def holdout_errors(self) -> np.ndarray:
        """Relative prediction errors on the held-out shapes (empty if none)."""
        return self._relative(self.holdout)

    def _errors(self) -> np.ndarray:
        return self.holdout_errors if self.holdout else self._relative(self.samples)

    @property
    def median_error(self) -> float:
        """Median relative error on the held-out shapes (on the training shapes if none)."""
        return float(np.median(self._errors()))

    @property
    def max_error(self) -> float:
        return float(np.max(self._errors()))

    def _refit(self, spec: FitSpec, statistic: Optional[str]):
        statistic = self.statistic if statistic is None else statistic
        return calibration_result(self.repeats, [spec.key(s) for s in self.samples],
                                  [spec.key(s) for s in self.holdout], spec, statistic, self.backend)

    def rows(self) -> list[dict]:
        """One dict per sample: its key's columns (q, c / B, L, K / B, K, joined, left),
        split ("fit"/"held-out"), measured_s, predicted_s, rel_error, spread (max/min of the
        repeats)."""
        out = []
        for split, samples in (("fit", self.samples), ("held-out", self.holdout)):
            for s in samples:
                key, t = self.spec.key(s), s[-1]
                pred, raw = self.spec.predict(self.fit, s), self.repeats.get(key, [t])
                out.append(dict(self.spec.labels(key), split=split, measured_s=t, predicted_s=pred,
                                rel_error=abs(pred - t) / t, spread=max(raw) / min(raw)))
        return out

    def table(self) -> str:
        """Measured vs predicted per sample, the fit and the error summary."""
        widths = {"q": 6, "c": 6, "B": 4, "L": 6, "K": 7, "joined": 6, "left": 5}
        keys = [(k, widths[k]) for k in self.spec.labels(self.spec.key(self.samples[0]))]
        head = " ".join(f"{k:>{w}}" for k, w in keys)
        lines = [f"{head} {'split':>9} {'measured ms':>12} {'predicted ms':>13} {'rel err':>8} {'max/min':>8}"]
        for r in self.rows():
            cells = " ".join(f"{r[k]:>{w}.1f}" if isinstance(r[k], float) else f"{r[k]:>{w}}" for k, w in keys)
            lines.append(f"{cells} {r['split']:>9} {r['measured_s'] * 1e3:>12.2f} {r['predicted_s'] * 1e3:>13.2f} "
                         f"{r['rel_error'] * 100:>7.1f}% {r['spread']:>8.2f}")
        where = "held-out" if self.holdout else "training (no held-out shapes)"
        lines.append(f"{self.fit}")
        lines.append(f"{where} relative error: median {self.median_error * 100:.1f} %, "
                     f"max {self.max_error * 100:.1f} %  [{self.statistic} of "
                     f"{min(len(v) for v in self.repeats.values())} repeats"
                     + (f", backend {self.backend}]" if self.backend else "]"))
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CalibrationResult(_Calibration):
    """Measured prefill times, the fit to the training shapes and its held-out error.

    ``samples`` / ``holdout``: (q, c, seconds), seconds the ``statistic`` ("median" or
    "min") of each shape's repeats; ``repeats``: raw times {(q, c): [seconds, ...]};
    ``fit``: fitted to ``samples`` only."""

    fit: PrefillCostFit

    def refit(self, *, intercept: Optional[bool] = None,
              statistic: Optional[str] = None) -> "CalibrationResult":
        """The same measurements, fitted with or without the constant term and/or
        summarised by another statistic (no new timing)."""
        intercept = self.spec.intercept if intercept is None else intercept
        return self._refit(FitSpec("prefill", intercept=intercept), statistic)


@dataclasses.dataclass(frozen=True)
class DecodeCalibrationResult(_Calibration):
    """Measured decode-step times, the fit t(B, K) = d0 + d1 B + d2 K to the training shapes
    and its held-out error.

    ``samples`` / ``holdout``: (B, K, seconds) with K = B * L the cached tokens of the
    batch; ``repeats``: raw times {(B, L): [seconds, ...]} keyed by the measured shape
    (B requests of L cached tokens each); ``fit``: fitted to ``samples`` only. With the
    handoff terms (``spec.handoff``, an engine's decode loop): samples (B, K, joined, left,
    seconds), keyed (B, K, joined, left)."""

    fit: DecodeCostFit
    spec: FitSpec = FitSpec("decode")

    def refit(self, *, statistic: Optional[str] = None) -> "DecodeCalibrationResult":
        """The same measurements summarised by another statistic and refitted."""
        return self._refit(self.spec, statistic)


# ---- the plans the model's timing checks before it runs --------------------------------------------

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


def check_decode_shapes(name: str, shapes, cfg) -> list[tuple[int, int]]:
    out = check_shapes(name, shapes, labels=("B", "L"), lows=(1, 1))
    for B, L in out:
        if L + 1 > cfg.max_position_embeddings:
            raise ValueError(f"{name}: shape (B={B}, L={L}) needs a cache of L + 1 = {L + 1} "
                             f"positions, over max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    return out


def _check_plan(shapes, holdout, statistic: str, need: int, who: str):
    _check_statistic(statistic)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    if len(shapes) < need:
        raise ValueError(f"{who} needs at least {need} fitting shapes, got {len(shapes)}")
    return shapes, holdout


def check_prefill_plan(shapes, holdout, intercept: bool, statistic: str):
    """(shapes, holdout) checked for a prefill calibration: integer (q, c) pairs, disjoint,
    enough fitting shapes for the model (3, 4 with the intercept)."""
    return _check_plan(check_shapes("shapes", shapes), check_shapes("holdout", holdout), statistic,
                       FitSpec("prefill", intercept=intercept).need, "calibrate")


def check_decode_plan(shapes, holdout, cfg, statistic: str):
    """(shapes, holdout) checked for a decode calibration: (B, L) pairs that fit the context,
    disjoint, at least 3 fitting shapes that separate d0, d1 and d2."""
    shapes, holdout = _check_plan(check_decode_shapes("shapes", shapes, cfg),
                                  check_decode_shapes("holdout", holdout, cfg), statistic, 3, "calibrate_decode")
    Bs = np.array([B for B, _ in shapes], np.float64)
    Ks = np.array([B * L for B, L in shapes], np.float64)
    if np.linalg.matrix_rank(decode_design_matrix(Bs, Ks)) < 3:
        raise ValueError("calibrate_decode: the fitting shapes do not separate d0, d1 and d2 "
                         "(vary B and K = B L independently, e.g. two B at two L)")
    return shapes, holdout
