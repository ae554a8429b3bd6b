"""The engines' token sampler: greedy or tempered top-p per row, keyed by (seed, generation
step), so a request samples the same tokens wherever it runs (its parameters:
:class:`pdjax.disagg.request.SamplingParams`); and :func:`verify_draft`, the acceptance of a
speculative draft token that keeps the sampled distribution exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _nucleus(logits_SV, temperature_S, top_p_S):
    """(order [S,V]: token ids best first, their tempered logits with the tokens outside the
    top-p nucleus at -inf)."""
    t = jnp.maximum(temperature_S, 1e-6)[:, None]
    scaled = logits_SV / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs          # mass of strictly better tokens
    keep_sorted = before < top_p_S[:, None]
    return order, jnp.where(keep_sorted, sorted_logits, -jnp.inf)


def _keys(seed_S, step_S):
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_S, step_S)


@jax.jit
def sample(logits_SV, temperature_S, top_p_S, seed_S, step_S):
    """One token per row: greedy where temperature is 0, else top-p sampling keyed by
    (seed, generation step)."""
    greedy = jnp.argmax(logits_SV, axis=-1)
    order, masked_sorted = _nucleus(logits_SV, temperature_S, top_p_S)
    pick = jax.vmap(jax.random.categorical)(_keys(seed_S, step_S), masked_sorted)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0]
    return jnp.where(temperature_S > 0, sampled, greedy).astype(jnp.int32)


def target_probs(logits_SV, temperature_S, top_p_S):
    """The distribution :func:`sample` draws from, per row, in token order [S,V] float32
    (one-hot at the argmax where temperature is 0)."""
    order, masked_sorted = _nucleus(logits_SV, temperature_S, top_p_S)
    rows = jnp.arange(logits_SV.shape[0])[:, None]
    probs = jnp.zeros(logits_SV.shape, jnp.float32).at[rows, order].set(jax.nn.softmax(masked_sorted, axis=-1))
    greedy = jax.nn.one_hot(jnp.argmax(logits_SV, axis=-1), logits_SV.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature_S > 0)[:, None], probs, greedy)


@jax.jit
def verify_draft(logits_SV, draft_S, temperature_S, top_p_S, seed_S, step_S):
    """Speculative sampling of the token at generation index ``step`` whose proposal was
    ``draft`` (a point mass: the drafter's greedy token): with p the target distribution
    (:func:`target_probs`), the draft is kept with probability p(draft), and otherwise a token
    is drawn from p with the draft's mass removed, renormalised. The token's distribution is
    p exactly: p(d) * [x = d] + (1 - p(d)) * p(x)[x != d] / (1 - p(d)) = p(x). Greedy rows
    (temperature 0, p one-hot) keep the draft exactly when it is the argmax, else take the
    argmax. Returns (tokens [S] int32, accepted [S] bool); keyed by (seed, step) like
    :func:`sample`, with the coin and the redraw on independent streams of that key."""
    p = target_probs(logits_SV, temperature_S, top_p_S)
    p_draft = jnp.take_along_axis(p, draft_S[:, None], axis=-1)[:, 0]
    keys = _keys(seed_S, step_S)
    coin = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    accepted = coin < p_draft
    rest = p.at[jnp.arange(p.shape[0]), draft_S].set(0.0)
    redraw = jax.vmap(jax.random.categorical)(jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys),
                                              jnp.where(rest > 0, jnp.log(jnp.where(rest > 0, rest, 1.0)), -jnp.inf))
    return jnp.where(accepted, draft_S, redraw).astype(jnp.int32), accepted
