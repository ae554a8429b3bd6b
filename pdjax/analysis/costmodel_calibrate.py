"""Calibrate the prefill and decode cost models against the real JAX model.

Decode (:func:`calibrate_decode`, :func:`measure_decode`) is described there; the rest of
this docstring is the prefill protocol.

For each shape (q, c) a cache of ``c + q`` positions is filled with a real prefix of c
tokens (chunked prefill in chunks of q), then a chunk of q new tokens is timed continuing
from it (``pdjax.prefill(..., cache=...)``, ``jax.block_until_ready``). The timed call gets
a fresh copy of the filled cache each time (the cache is donated); one untimed call on such
a copy first compiles and warms exactly the timed program. Compilation and warm-up are
excluded; repeats are interleaved over the shapes in a shuffled order, so a burst of
load from other processes spreads over all shapes instead of biasing one; each shape's
time is the median (or, on request, the min) of its repeats.

pdjax's reference prefill attends over the whole cache buffer (masked), so a buffer of
exactly c + q positions makes the attention cost that of (q, c).

jax is imported lazily: ``import pdjax.analysis`` stays pure Python.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

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


def _check_shapes(name: str, shapes, labels=("q", "c"), lows=(1, 0)) -> list[tuple[int, int]]:
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


def measure_prefill(params, cfg, shapes: Sequence[tuple[int, int]], repeats: int = 5, *,
                    batch: int = 1, seed: int = 0) -> dict:
    """Median seconds of one real chunked-prefill call for each (q, c) shape:
    {(q, c): [seconds of each repeat]}. See the module docstring for the protocol."""
    import jax
    import jax.numpy as jnp

    import pdjax
    from pdjax.model.cache import init_cache
    from pdjax.model.transformer import param_dtype

    shapes = _check_shapes("shapes", shapes)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    for q, c in shapes:
        if q + c > cfg.max_position_embeddings:
            raise ValueError(f"shape (q={q}, c={c}) exceeds max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(0, cfg.vocab_size, (batch, n), dtype=np.int32)

    def fresh(cache):
        return jax.block_until_ready(jax.tree.map(jnp.copy, cache))

    prepared = []
    for q, c in shapes:
        cache = init_cache(cfg, batch, q + c, param_dtype(params))
        done = 0
        while done < c:                  # the prefix, in chunks of q
            n = min(q, c - done)
            _, cache = pdjax.prefill(params, cfg, tokens(n), cache=cache)
            done += n
        cache = jax.block_until_ready(cache)
        chunk = tokens(q)
        # compile + warm-up on exactly what is timed (a copy of the filled cache: the fill's
        # own calls may have compiled for other placements, e.g. params on a mesh)
        jax.block_until_ready(pdjax.prefill(params, cfg, chunk, cache=fresh(cache)))
        prepared.append(((q, c), cache, chunk))

    times = {shape: [] for shape in shapes}
    for _ in range(repeats):
        for i in rng.permutation(len(prepared)):
            shape, cache, chunk = prepared[i]
            work = fresh(cache)
            t0 = time.perf_counter()
            jax.block_until_ready(pdjax.prefill(params, cfg, chunk, cache=work))
            times[shape].append(time.perf_counter() - t0)
    return times


def calibrate(params, cfg, shapes: Sequence[tuple[int, int]], repeats: int = 5, *,
              holdout: Sequence[tuple[int, int]] = (), intercept: bool = False,
              batch: int = 1, seed: int = 0, statistic: str = "median") -> CalibrationResult:
    """Measure the real prefill of ``cfg`` on the current jax backend for ``shapes`` (fit)
    and ``holdout`` (held-out, measured in the same interleaved rounds), fit
    cost(q, c) = a q^2 + b q c + g q (+ d with ``intercept=True``) to the medians of
    ``shapes`` and report the held-out relative error. Needs >= 3 fitting shapes (4 with
    the intercept). Keep shapes where a call takes well above the timer's noise (> ~5 ms).
    ``statistic``: "median" (default) or "min" of the repeats (the min is robust to load
    from other processes, which only ever adds time)."""
    import jax

    _check_statistic(statistic)

    shapes = _check_shapes("shapes", shapes)
    holdout = _check_shapes("holdout", holdout)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    need = 4 if intercept else 3
    if len(shapes) < need:
        raise ValueError(f"calibrate needs at least {need} fitting shapes, got {len(shapes)}")
    times = measure_prefill(params, cfg, shapes + holdout, repeats, batch=batch, seed=seed)
    samples, held = _summarise(times, shapes, holdout, statistic)
    return CalibrationResult(fit=fit_prefill_cost(samples, intercept=intercept), samples=samples,
                             holdout=held, repeats=times, backend=jax.default_backend(),
                             statistic=statistic)


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


def _check_decode_shapes(name: str, shapes, cfg) -> list[tuple[int, int]]:
    out = _check_shapes(name, shapes, labels=("B", "L"), lows=(1, 1))
    for B, L in out:
        if L + 1 > cfg.max_position_embeddings:
            raise ValueError(f"{name}: shape (B={B}, L={L}) needs a cache of L + 1 = {L + 1} "
                             f"positions, over max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
    return out


def measure_decode(params, cfg, shapes: Sequence[tuple[int, int]], repeats: int = 5, *,
                   seed: int = 0, distinct_rows: Optional[int] = None,
                   prefill_tokens: int = 8192) -> dict:
    """Seconds of one real ``pdjax.decode_step`` for each (B, L) shape: B requests, each
    with L cached tokens, so the step reads K = B L cached tokens. Returns
    {(B, L): [seconds of each repeat]}.

    The cache of each shape holds exactly L + 1 positions (the reference decode attends
    over the whole buffer, masked, so its cost is that of L cached tokens plus the new
    one). Its contents come from one real ``pdjax.prefill(..., max_len=L_max + 1)`` of
    random prompts of the longest L asked for: a shape's cache is the first L positions
    of it (exactly the prefill of the first L tokens: the prefill is causal), cut to a
    buffer of L + 1. ``distinct_rows`` (default: the largest B) prompts are prefilled, in
    row groups of about ``prefill_tokens`` tokens to bound the prefill's memory, and a
    batch of B > ``distinct_rows`` repeats them (the timing depends on the cache's
    contents only through the MoE routing, which the distinct next tokens of each row
    keep varied). Each shape is compiled and run once before timing; each timed call gets
    a fresh copy of the cache (it is donated) and new random next tokens, and ends in
    ``block_until_ready``. Repeats are interleaved over the shapes in shuffled rounds."""
    import jax
    import jax.numpy as jnp

    import pdjax
    from pdjax.model.cache import KVCache

    shapes = _check_decode_shapes("shapes", shapes, cfg)
    for name, value in (("repeats", repeats), ("prefill_tokens", prefill_tokens),
                        ("distinct_rows", 1 if distinct_rows is None else distinct_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    rng = np.random.default_rng(seed)

    def tokens(*shape):
        return rng.integers(0, cfg.vocab_size, shape, dtype=np.int32)

    def fresh(cache):
        return jax.block_until_ready(jax.tree.map(jnp.copy, cache))

    L_max = max(L for _, L in shapes)
    B_max = max(B for B, _ in shapes)
    rows = B_max if distinct_rows is None else min(B_max, distinct_rows)
    group = max(1, prefill_tokens // L_max)
    parts = [pdjax.prefill(params, cfg, tokens(min(group, rows - start), L_max),
                           max_len=L_max + 1)[1] for start in range(0, rows, group)]
    full = jax.block_until_ready(tuple(jnp.concatenate(layer) for layer in
                                       zip(*(p.kv for p in parts))))

    prepared = []
    for B, L in shapes:
        pick = jnp.asarray(np.arange(B) % rows)
        cache = jax.block_until_ready(KVCache(
            kv=tuple(jnp.take(k[:, :L + 1], pick, axis=0) for k in full),
            lengths=jnp.full((B,), L, jnp.int32)))
        # compile + warm-up, excluded from the timings
        jax.block_until_ready(pdjax.decode_step(params, cfg, tokens(B), fresh(cache)))
        prepared.append(((B, L), cache))
    del parts, full

    times = {shape: [] for shape in shapes}
    for _ in range(repeats):
        for i in rng.permutation(len(prepared)):
            (B, L), cache = prepared[i]
            nxt = jax.block_until_ready(jnp.asarray(tokens(B)))
            work = fresh(cache)
            t0 = time.perf_counter()
            jax.block_until_ready(pdjax.decode_step(params, cfg, nxt, work))
            times[(B, L)].append(time.perf_counter() - t0)
    return times


def calibrate_decode(params, cfg, shapes: Sequence[tuple[int, int]], repeats: int = 5, *,
                     holdout: Sequence[tuple[int, int]] = (), seed: int = 0,
                     statistic: str = "median", distinct_rows: Optional[int] = None,
                     prefill_tokens: int = 8192) -> DecodeCalibrationResult:
    """Measure real decode steps of ``cfg`` on the current jax backend for ``shapes``
    (B requests, L cached tokens each; fitted) and ``holdout`` (measured in the same
    interleaved rounds, only predicted), fit t(B, K) = d0 + d1 B + d2 K with K = B L to the
    ``statistic`` ("median" or "min") of each fitted shape's repeats, and report the
    held-out relative error. Needs >= 3 fitting shapes that vary both B and K
    independently (the columns [1, B, K] of full rank). See :func:`measure_decode`."""
    import jax

    _check_statistic(statistic)
    shapes = _check_decode_shapes("shapes", shapes, cfg)
    holdout = _check_decode_shapes("holdout", holdout, cfg)
    if set(shapes) & set(holdout):
        raise ValueError(f"shapes and holdout overlap: {sorted(set(shapes) & set(holdout))}")
    if len(shapes) < 3:
        raise ValueError(f"calibrate_decode needs at least 3 fitting shapes, got {len(shapes)}")
    Bs = np.array([B for B, _ in shapes], np.float64)
    Ks = np.array([B * L for B, L in shapes], np.float64)
    if np.linalg.matrix_rank(decode_design_matrix(Bs, Ks)) < 3:
        raise ValueError("calibrate_decode: the fitting shapes do not separate d0, d1 and d2 "
                         "(vary B and K = B L independently, e.g. two B at two L)")
    times = measure_decode(params, cfg, shapes + holdout, repeats, seed=seed,
                           distinct_rows=distinct_rows, prefill_tokens=prefill_tokens)
    samples, held = _summarise_decode(times, shapes, holdout, statistic)
    return DecodeCalibrationResult(fit=fit_decode_cost(samples), samples=samples, holdout=held,
                                   repeats=times, backend=jax.default_backend(),
                                   statistic=statistic)
