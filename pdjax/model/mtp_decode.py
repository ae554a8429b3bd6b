"""Greedy generation with MTP speculative decoding (``pdjax.generate(..., speculative="mtp")``).

The MTP module's depth 1 drafts the token after next; the main model verifies it in the next
step, which runs two tokens per row (the last emitted token and the draft, positions p and
p+1) through the model at once:

* the main model's greedy token at p is emitted. If it equals the draft, the draft was
  right and the main model's token at p+1 is emitted too (two tokens in one step);
  otherwise the row's cache keeps position p only (the draft's row at p+1 is stale and
  overwritten by the next step);
* depth 1 runs on the same two positions (the main model's normed states there and the
  embeddings of the tokens now known to follow them) and drafts again from the last
  position kept.

Every emitted token is the main model's greedy choice given the tokens before it, so the
output equals plain greedy generation (up to float rounding of the two-token chunks: the
tests compare exactly). The loop runs on the device (``lax.while_loop``) until every row
has ``max_new_tokens``; rows that finished early ride along without growing. Drafts come
from depth 1 only (further depths, when a config has them, are trained but not used to
draft).

Stats: ``accept_rate`` (accepted drafts / drafts verified), ``tokens_per_step`` (tokens the
decode steps emitted per row-step: 1 + accept_rate before the last step's overshoot is cut),
``steps`` (decode iterations), ``drafts``, and ``near_ties``: emitted tokens whose model
logits had their top two within :data:`NEAR_TIE` (a two-token verify and a one-token step are
different programs: at such a near tie their greedy choices may differ by rounding alone).

Cost (docs/model.md, "MTP decoding benchmark"): the near-tie test compares the greedy
token's logit with the largest other one (``lax.top_k`` sorted every row on XLA:CPU: a
fifth of a step at batch 1, a third at batch 32), and the output is written by selects, not
scatters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig
from pdjax.model import mtp
from pdjax.model import transformer as tfm
from pdjax.model.cache import KVCache, to_cache_dtype
from pdjax.model.checks import check_layers
from pdjax.model.prompts import pad_prompts

#: top-two logit gap under which an emitted token counts as a near tie
NEAR_TIE = 1e-5


def _mtp_fresh(params, cfg, g_BTD, next_BT, lengths_B, max_len, moe_impl):
    """Depth 1 over a prompt (no cache yet): (its normed states [B,T,D], its one-layer cache)."""
    B, T = next_BT.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = tfm._valid(T, lengths_B)
    emb = tfm.embed(params, next_BT, cfg)
    g1, kv = mtp.depth_block(params[mtp.MTP][0], cfg, emb, g_BTD, q_pos, tfm.layer, moe_impl=moe_impl,
                             valid_BT=valid)
    kv = jnp.pad(to_cache_dtype(kv, cfg.kv_cache_dtype), ((0, 0), (0, max_len - T), (0, 0)))
    return g1, KVCache(kv=(kv,), lengths=lengths_B.astype(jnp.int32))


def _at(x_BT, index_B):
    """x[b, index[b]] for each row."""
    return jnp.take_along_axis(x_BT, index_B[:, None, None] if x_BT.ndim == 3 else index_B[:, None], axis=1)[:, 0]


def _greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _near_tie(logits, greedy):
    """Whether the top two logits are within :data:`NEAR_TIE` (per row/position), ``greedy``
    their argmax: its logit against the largest of the others (``lax.top_k(logits, 2)``'s
    two values, a tie counted twice, without the sort XLA:CPU runs it as)."""
    top = jnp.take_along_axis(logits, greedy[..., None], axis=-1)[..., 0]
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    second = jnp.max(jnp.where(vocab == greedy[..., None], -jnp.inf, logits), axis=-1)
    return (top - second) < NEAR_TIE


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "moe_impl"))
def _prefill(params, cfg, tokens_BT, lengths_B, max_len, moe_impl=None):
    """The prompt through the model and depth 1: (first token [B], first draft [B], caches)."""
    x, cache = tfm.fresh_core(params, cfg, tokens_BT, lengths_B, max_len, False, moe_impl)
    g = tfm.final_hidden(params, cfg, x)
    last = lengths_B - 1
    first_logits = tfm.logits_of(params, _at(g, last))
    first = _greedy(first_logits)
    B, T = tokens_BT.shape
    nxt = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros((B, 1), tokens_BT.dtype)], axis=1)
    nxt = jnp.where(jnp.arange(T)[None, :] == last[:, None], first[:, None], nxt).astype(jnp.int32)
    g1, mtp_cache = _mtp_fresh(params, cfg, g, nxt, lengths_B, max_len, moe_impl)
    draft = _greedy(tfm.logits_of(params, _at(g1, last)))
    return first, draft, cache, mtp_cache, jnp.sum(_near_tie(first_logits, first))


def _emit(out, n, a_B2, active, accepted):
    """``out`` with a[:, 0] at column n of each active row and a[:, 1] at n + 1 of each row
    whose draft was accepted (two selects: XLA:CPU runs a scatter as a loop)."""
    col = jnp.arange(out.shape[1], dtype=jnp.int32)[None, :] - n[:, None]
    out = jnp.where((col == 0) & active[:, None], a_B2[:, :1], out)
    return jnp.where((col == 1) & accepted[:, None], a_B2[:, 1:], out)


def verify_and_draft(params, cfg, moe_impl, cache, mtp_layer, last_B, draft_B, active_B, choose):
    """One speculative step's core, for any cache (contiguous or paged): [last, draft] through
    the model as a two-token chunk at positions p, p+1 (absorbed MLA); ``choose(logits
    [B,2,V]) -> (token after p, token after p+1, draft accepted)``; depth 1 on the same two
    positions (``mtp_layer``: its cache layer, at the same lengths) and its greedy draft from
    the last position kept. Returns (logits, the two tokens [B,2], accepted, tokens kept
    [B] (0 for inactive rows), the cache with its lengths advanced by them, the MTP layer,
    the next draft)."""
    start = cache.lengths
    chunk = jnp.stack([last_B, draft_B], axis=1)                           # positions start, start+1
    valid = jnp.broadcast_to(active_B[:, None], chunk.shape)               # finished rows: off the experts
    x, cache = tfm.chunk_core(params, cfg, chunk, cache, jnp.zeros_like(start), True, moe_impl, valid)
    g = tfm.final_hidden(params, cfg, x)
    logits = tfm.logits_of(params, g)
    t0, t1, accepted = choose(logits)
    accepted = accepted & active_B
    keep = jnp.where(active_B, 1 + accepted.astype(jnp.int32), 0)
    follow = jnp.stack([t0, t1], axis=1)
    q_pos = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
    g1, mtp_layer = mtp.depth_block(params[mtp.MTP][0], cfg, tfm.embed(params, follow, cfg), g, q_pos, tfm.layer,
                                    mtp_layer, start, True, moe_impl, valid)
    draft = _greedy(tfm.logits_of(params, _at(g1, accepted.astype(jnp.int32))))
    return logits, follow, accepted, keep, cache.with_layers(cache.layers(), start + keep), mtp_layer, draft


def choose_greedy(draft_B):
    """``verify_and_draft``'s ``choose`` for greedy decoding: the model's argmax at both
    positions; the draft is accepted when it is the first."""
    def choose(logits):
        a = _greedy(logits)
        return a[:, 0], a[:, 1], a[:, 0] == draft_B
    return choose


def _step(params, cfg, moe_impl, state):
    """One verification step of every row (see the module docstring)."""
    last, draft, cache, mtp_cache, out, n, counts, max_new = state
    active = n < max_new
    logits, a, accepted, keep, cache, kv, draft = verify_and_draft(
        params, cfg, moe_impl, cache, mtp_cache.kv[0], last, draft, active, choose_greedy(draft))
    mtp_cache = KVCache(kv=(kv,), lengths=mtp_cache.lengths + keep)
    out = _emit(out, n, a, active, accepted)
    last = jnp.where(accepted, a[:, 1], jnp.where(active, a[:, 0], last))
    ties = _near_tie(logits, a)
    counts = counts + jnp.stack([jnp.sum(active), jnp.sum(accepted), jnp.any(active).astype(jnp.int32),
                                 jnp.sum(ties[:, 0] & active) + jnp.sum(ties[:, 1] & accepted)])
    return last, draft, cache, mtp_cache, out, n + keep, counts, max_new


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "moe_impl"))
def _loop(params, cfg, first, draft, cache, mtp_cache, max_new, moe_impl=None):
    B = first.shape[0]
    out = jnp.zeros((B, max_new + 1), jnp.int32).at[:, 0].set(first)
    state = (first, draft, cache, mtp_cache, out, jnp.ones((B,), jnp.int32), jnp.zeros((4,), jnp.int32),
             jnp.int32(max_new))
    state = jax.lax.while_loop(lambda s: jnp.any(s[5] < s[7]), functools.partial(_step, params, cfg, moe_impl),
                               state)
    return state[4][:, :max_new], state[6]


def generate(params, cfg: ModelConfig, prompts, *, max_new_tokens: int, max_len: int | None = None,
             moe_impl=None):
    """Greedy generation with MTP drafts: (what :func:`pdjax.model.transformer.generate`
    returns for ``prompts``, stats). ``max_len``: the caches' positions, at least the longest
    prompt + ``max_new_tokens`` + 2 (a step writes one row past what it keeps, and a finished
    row one more); default exactly that."""
    check_int("max_new_tokens", max_new_tokens)
    mtp.check_speculative(params, cfg, "mtp")
    check_layers(params, cfg, None, moe_impl)              # params["mtp"] included
    tokens, lengths, ragged = pad_prompts(cfg, prompts)
    need = int(lengths.max()) + max_new_tokens + 2
    max_len = need if max_len is None else check_int("max_len", max_len)
    if need > max_len:
        raise ValueError(f"prompt ({int(lengths.max())}) + max_new_tokens ({max_new_tokens}) + 2 exceeds "
                         f"max_len={max_len} (speculative decoding writes up to two rows past the output)")
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    new, stats = _generate(params, cfg, tokens, lengths, max_new_tokens, max_len, moe_impl)
    if ragged:
        return [new[i].tolist() for i in range(len(prompts))], stats
    return np.concatenate([tokens.astype(np.int32), new], axis=1), stats


def _generate(params, cfg: ModelConfig, tokens, lengths, max_new_tokens: int, max_len: int, moe_impl=None):
    """(new tokens [B, max_new_tokens] numpy, stats) for right-padded prompts [B,T]."""
    lengths = jnp.asarray(lengths, jnp.int32)
    first, draft, cache, mtp_cache, ties = _prefill(params, cfg, jnp.asarray(tokens, jnp.int32), lengths, max_len,
                                                    moe_impl)
    new, counts = _loop(params, cfg, first, draft, cache, mtp_cache, max_new_tokens, moe_impl)
    drafts, accepted, steps, step_ties = (int(c) for c in np.asarray(counts))
    stats = {"accept_rate": accepted / drafts if drafts else None,
             "tokens_per_step": (drafts + accepted) / drafts if drafts else None,
             "steps": steps, "drafts": drafts, "near_ties": int(ties) + step_ties}
    return np.asarray(new), stats
