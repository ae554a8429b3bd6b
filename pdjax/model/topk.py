"""``top_k`` without a sort: the router's and the dispatch plan's choice of the k largest.

``jax.lax.top_k`` gives the same values and indices, but XLA:CPU compiles it (in a large
program) to a sort or a ``TopK`` call whose comparator cannot be serialized ("`LessThan` is
not serializable"), so a compiled MoE stage could not be loaded on another device
(:mod:`pdjax.pipeline.relocate`) and every copy was compiled again. Here each of the k picks is
a max and an argmax (reductions, serializable everywhere); k is small (2 to 8 experts, a few
groups), so this costs k passes over the last axis.

Exactly ``jax.lax.top_k``'s result, ties and non-finite values included: the order is the
total order XLA sorts floats by (-NaN < -inf < ... < -0.0 < 0.0 < ... < inf < NaN), and of
equal values the lower index comes first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _total_order_key(x):
    """An integer key whose order is the float total order of ``x`` (integers: themselves)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def top_k(x, k: int):
    """(values, indices) of the ``k`` largest entries along the last axis, largest first;
    indices int32. ``x``: a float or integer array of at least ``k`` entries on that axis."""
    n = x.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"top_k: k={k} outside 0..{n} (the last axis of {x.shape})")
    key = _total_order_key(x)
    lowest = jnp.iinfo(key.dtype).min
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    taken = jnp.zeros(x.shape, bool)
    picks = []
    for _ in range(k):
        best = jnp.max(jnp.where(taken, lowest, key), axis=-1, keepdims=True)
        i = jnp.argmax((key == best) & ~taken, axis=-1).astype(jnp.int32)   # the first not taken
        taken = taken | (iota == i[..., None])
        picks.append(i)
    idx = jnp.stack(picks, -1) if picks else jnp.zeros(x.shape[:-1] + (0,), jnp.int32)
    return jnp.take_along_axis(x, idx, axis=-1), idx
