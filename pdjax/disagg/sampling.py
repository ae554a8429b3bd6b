"""The engines' token sampler: greedy or tempered top-p per row, keyed by (seed, generation
step), so a request samples the same tokens wherever it runs (its parameters:
:class:`pdjax.disagg.request.SamplingParams`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def sample(logits_SV, temperature_S, top_p_S, seed_S, step_S):
    """One token per row: greedy where temperature is 0, else top-p sampling keyed by
    (seed, generation step)."""
    greedy = jnp.argmax(logits_SV, axis=-1)
    t = jnp.maximum(temperature_S, 1e-6)[:, None]
    scaled = logits_SV / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass of strictly better tokens
    keep_sorted = before < top_p_S[:, None]
    masked_sorted = jnp.where(keep_sorted, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_S, step_S)
    pick = jax.vmap(jax.random.categorical)(keys, masked_sorted)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(temperature_S > 0, sampled, greedy).astype(jnp.int32)
