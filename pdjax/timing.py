"""Timing the real model for the cost model's calibration: ``pdjax.prefill`` chunks and
``pdjax.decode_step`` batches on the current jax backend, and the fits of
:mod:`pdjax.analysis.costmodel_fit` to them (the results and their checks are
:mod:`pdjax.analysis.costmodel_calibrate`, pure Python).

Prefill (:func:`measure_prefill`, :func:`calibrate`). For each shape (q, c) a cache of
``c + q`` positions is filled with a real prefix of c tokens (chunked prefill in chunks of
q), then a chunk of q new tokens is timed continuing from it (``pdjax.prefill(...,
cache=...)``, ``jax.block_until_ready``). The timed call gets a fresh copy of the filled
cache each time (the cache is donated); one untimed call on such a copy first compiles and
warms exactly the timed program. Compilation and warm-up are excluded; repeats are
interleaved over the shapes in a shuffled order, so a burst of load from other processes
spreads over all shapes instead of biasing one; each shape's time is the median (or, on
request, the min) of its repeats. pdjax's reference prefill attends over the whole cache
buffer (masked), so a buffer of exactly c + q positions makes the attention cost that of
(q, c).

Decode (:func:`measure_decode`, :func:`calibrate_decode`): see :func:`measure_decode`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdjax import api
from pdjax.analysis.costmodel_calibrate import (CalibrationResult, DecodeCalibrationResult, FitSpec, calibrate_cost,
                                                check_decode_plan, check_decode_shapes, check_prefill_plan,
                                                check_shapes, time_shapes)
from pdjax.arguments import check_int
from pdjax.model.cache import KVCache, init_cache
from pdjax.model.transformer import param_dtype


def _fresh(cache):
    """A ready copy of ``cache`` (the timed calls donate theirs)."""
    return jax.block_until_ready(jax.tree.map(jnp.copy, cache))


def _timed(fn, *args) -> float:
    """Seconds of ``fn(*args)``, waited for."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _prefill_timer(params, cfg, shapes, batch: int, rng):
    """measure((q, c)) -> seconds of one chunk of q tokens continuing a filled cache of c + q
    positions (a fresh copy of it each call, made before the clock starts)."""
    for q, c in shapes:
        if q + c > cfg.max_position_embeddings:
            raise ValueError(f"shape (q={q}, c={c}) exceeds max_position_embeddings="
                             f"{cfg.max_position_embeddings}")

    def tokens(n):
        return rng.integers(0, cfg.vocab_size, (batch, n), dtype=np.int32)

    prepared = {}
    for q, c in shapes:
        cache = init_cache(cfg, batch, q + c, param_dtype(params))
        done = 0
        while done < c:                  # the prefix, in chunks of q
            n = min(q, c - done)
            _, cache = api.prefill(params, cfg, tokens(n), cache=cache)
            done += n
        prepared[(q, c)] = (jax.block_until_ready(cache), tokens(q))

    def measure(shape):
        cache, chunk = prepared[shape]
        return _timed(lambda fresh: api.prefill(params, cfg, chunk, cache=fresh), _fresh(cache))
    return measure


def measure_prefill(params, cfg, shapes: Sequence[tuple[int, int]], repeats: int = 5, *,
                    batch: int = 1, seed: int = 0) -> dict:
    """Seconds of one real chunked-prefill call for each (q, c) shape:
    {(q, c): [seconds of each repeat]}. See the module docstring for the protocol."""
    shapes = check_shapes("shapes", shapes)
    check_int("repeats", repeats)
    measure = _prefill_timer(params, cfg, shapes, batch, np.random.default_rng(seed))
    return time_shapes(measure, shapes, repeats, warmup=1, seed=seed)[0]


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
    shapes, holdout = check_prefill_plan(shapes, holdout, intercept, statistic)
    check_int("repeats", repeats)
    measure = _prefill_timer(params, cfg, shapes + holdout, batch, np.random.default_rng(seed))
    return calibrate_cost(measure, shapes, repeats, fit=FitSpec("prefill", intercept=intercept), holdout=holdout,
                          statistic=statistic, warmup=1, seed=seed, backend=jax.default_backend())


def _decode_timer(params, cfg, shapes, rng, distinct_rows, prefill_tokens):
    """measure((B, L)) -> seconds of one decode step of B rows of L cached tokens (the first
    L positions of one real prefill of the longest L, cut to L + 1; rows repeated past
    ``distinct_rows``), with new random next tokens and a fresh copy of the cache each call."""
    def tokens(*shape):
        return rng.integers(0, cfg.vocab_size, shape, dtype=np.int32)

    L_max = max(L for _, L in shapes)
    B_max = max(B for B, _ in shapes)
    rows = B_max if distinct_rows is None else min(B_max, distinct_rows)
    group = max(1, prefill_tokens // L_max)
    parts = [api.prefill(params, cfg, tokens(min(group, rows - start), L_max), max_len=L_max + 1)[1]
             for start in range(0, rows, group)]
    full = jax.block_until_ready(tuple(jnp.concatenate(layer) for layer in zip(*(p.kv for p in parts))))
    prepared = {}
    for B, L in shapes:
        pick = jnp.asarray(np.arange(B) % rows)
        prepared[(B, L)] = jax.block_until_ready(KVCache(kv=tuple(jnp.take(k[:, :L + 1], pick, axis=0) for k in full),
                                                         lengths=jnp.full((B,), L, jnp.int32)))

    def measure(shape):
        nxt = jax.block_until_ready(jnp.asarray(tokens(shape[0])))
        return _timed(lambda cache: api.decode_step(params, cfg, nxt, cache), _fresh(prepared[shape]))
    return measure


def _check_decode_options(repeats, distinct_rows, prefill_tokens) -> None:
    for name, value in (("repeats", repeats), ("prefill_tokens", prefill_tokens),
                        ("distinct_rows", 1 if distinct_rows is None else distinct_rows)):
        check_int(name, value)


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
    shapes = check_decode_shapes("shapes", shapes, cfg)
    _check_decode_options(repeats, distinct_rows, prefill_tokens)
    measure = _decode_timer(params, cfg, shapes, np.random.default_rng(seed), distinct_rows, prefill_tokens)
    return time_shapes(measure, shapes, repeats, warmup=1, seed=seed)[0]


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
    shapes, holdout = check_decode_plan(shapes, holdout, cfg, statistic)
    _check_decode_options(repeats, distinct_rows, prefill_tokens)
    measure = _decode_timer(params, cfg, shapes + holdout, np.random.default_rng(seed), distinct_rows,
                            prefill_tokens)
    return calibrate_cost(measure, shapes, repeats, fit=FitSpec("decode"), holdout=holdout, statistic=statistic,
                          warmup=1, seed=seed, backend=jax.default_backend())
