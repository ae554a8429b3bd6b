"""Calibrate the prefill cost model against the real JAX chunked prefill.

For each shape (q, c) a cache of ``c + q`` positions is filled with a real prefix of c
tokens (chunked prefill in chunks of q, so the prefix reuses the program being timed,
which also warms it up), then a chunk of q new tokens is timed continuing from it
(``pdjax.prefill(..., cache=...)``, ``jax.block_until_ready``). The timed call gets a fresh
copy of the filled cache each time (the cache is donated). Compilation and warm-up are
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

from pdjax.analysis.costmodel_fit import PrefillCostFit, fit_prefill_cost, relative_errors


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
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

    @property
    def holdout_errors(self) -> np.ndarray:
        """Relative prediction errors on the held-out shapes (empty if none)."""
        return relative_errors(self.fit, self.holdout) if self.holdout else np.zeros(0)

    @property
    def median_error(self) -> float:
        """Median relative error on the held-out shapes (on the training shapes if there
        are none)."""
        errs = self.holdout_errors if self.holdout else relative_errors(self.fit, self.samples)
        return float(np.median(errs))

    @property
    def max_error(self) -> float:
        errs = self.holdout_errors if self.holdout else relative_errors(self.fit, self.samples)
        return float(np.max(errs))

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
        lines = [f"{'q':>6} {'c':>6} {'split':>9} {'measured ms':>12} {'predicted ms':>13} "
                 f"{'rel err':>8} {'max/min':>8}"]
        for r in self.rows():
            lines.append(f"{r['q']:>6} {r['c']:>6} {r['split']:>9} {r['measured_s'] * 1e3:>12.2f} "
                         f"{r['predicted_s'] * 1e3:>13.2f} {r['rel_error'] * 100:>7.1f}% "
                         f"{r['spread']:>8.2f}")
        where = "held-out" if self.holdout else "training (no held-out shapes)"
        lines.append(f"{self.fit}")
        lines.append(f"{where} relative error: median {self.median_error * 100:.1f} %, "
                     f"max {self.max_error * 100:.1f} %  [{self.statistic} of "
                     f"{min(len(v) for v in self.repeats.values())} repeats, "
                     f"backend {self.backend}]")
        return "\n".join(lines)


STATISTICS = {"median": np.median, "min": np.min}


def _check_statistic(statistic: str) -> str:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(STATISTICS)}, got {statistic!r}")
    return statistic


def _summarise(times: dict, shapes, holdout, statistic: str):
    f = STATISTICS[statistic]
    one = lambda qc: (int(qc[0]), int(qc[1]), float(f(times[(int(qc[0]), int(qc[1]))])))  # noqa: E731
    return tuple(map(one, shapes)), tuple(map(one, holdout))


def _check_shapes(name: str, shapes) -> list[tuple[int, int]]:
    out = []
    for item in shapes:
        try:
            q, c = (int(v) for v in item)
            ok = all(int(v) == v for v in item)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{name} must hold integer (q, c) pairs, got {item!r}")
        if q < 1 or c < 0:
            raise ValueError(f"{name}: need q >= 1 and c >= 0, got {(q, c)}")
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
        done, warm = 0, False
        while done < c:                  # the prefix, in chunks of q (the timed program)
            n = min(q, c - done)
            _, cache = pdjax.prefill(params, cfg, tokens(n), cache=cache)
            done, warm = done + n, warm or n == q
        cache = jax.block_until_ready(cache)
        chunk = tokens(q)
        if not warm:                     # compile + warm-up, excluded from the timings
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
