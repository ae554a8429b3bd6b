"""The DeepSeek-V2/V3 decoder: forward, prefill, decode_step, generate (their params from
:mod:`pdjax.model.params`, their input checks in :mod:`pdjax.model.checks`).

Params are a plain dict pytree::

  {"embed": [V,D], "final_norm": [D], "lm_head": [D,V],
   "layers": [ {"attn_norm": [D], "attn": {...mla...}, "ffn_norm": [D],
                "mlp": {w_gate [D,F], w_up [D,F], w_down [F,D]}          # dense layers
                | "moe": {router [D,E], (router_bias [E]), w_gate [E,D,F], w_up [E,D,F],
                          w_down [E,F,D], (shared: {w_gate, w_up, w_down})}}, ...]}

or, opt-in, stacked per run of same-kind layers (``"layer_runs"`` in place of ``"layers"``,
:mod:`pdjax.model.layer_scan`): each run is one ``lax.scan``, so compile time stops growing
with depth; its cache is a ``StackedKVCache``.

Precision (``ModelConfig.param_dtype / compute_dtype / cache_dtype``): params are stored in
their own dtype (``router_bias`` always float32); the embedding output is cast to the
compute dtype, every layer runs its activations (the residual stream) in it, and each weight
is cast to it where it is used. Float32 inside, whatever the compute dtype: RMSNorm, RoPE,
the attention scores (``preferred_element_type``) and softmax, the router logits and scores,
the weighted sum of the experts' outputs, and the logits (accumulated and returned in
float32). New latents are rounded to the cache dtype when written and read back in the
compute dtype.

Every public function validates its inputs on the host (:mod:`pdjax.model.checks`) and raises
ValueError before any compute; the jitted cores below take the config as a static argument. Host inputs (numpy,
lists) are checked in full; device arrays (jax.Array) for shape and dtype only, and a cache's
bounds against the lengths the host recorded for it (:func:`pdjax.model.cache.host_lengths`):
no check fetches a device value, so a loop of ``decode_step`` calls feeding back device
tokens dispatches ahead of the device without waiting for any step.
"""

from __future__ import annotations

import functools
import warnings
import jax
import jax.numpy as jnp
import numpy as np

from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig
from pdjax.model import dsa, layer_scan, mla
from pdjax.model.dots import logits_of
from pdjax.model import moe as moe_lib
from pdjax.model.cache import KVCache, host_lengths, remember_lengths, to_cache_dtype, write_rows
from pdjax.model.checks import check_cache, check_layers, check_lengths, check_tokens, is_tracer, on_device
from pdjax.model.prompts import pad_prompts
# init_params and param_dtype live in pdjax.model.params; importable here, where callers look
from pdjax.model.params import init_params, param_dtype  # noqa: F401


# ---- one layer ----------------------------------------------------------------------------

def ffn(lp, cfg: ModelConfig, x_BTD, moe_impl=None, valid_BT=None):
    """Dense SwiGLU MLP or routed+shared MoE, by which the layer holds. ``valid_BT``: False
    marks padding tokens, kept out of the experts' way (:func:`pdjax.model.moe.mask_routing`)."""
    if "moe" in lp:
        B, T, D = x_BTD.shape
        valid = None if valid_BT is None else valid_BT.reshape(B * T)
        return moe_lib.moe(lp["moe"], cfg, x_BTD.reshape(B * T, D), moe_impl, valid).reshape(B, T, D)
    m = lp["mlp"]
    return moe_lib.swiglu(x_BTD, m["w_gate"], m["w_up"], m["w_down"])


CAUSAL_BLOCKS = 4


def attention(lp, cfg: ModelConfig, x_BTD, q_pos_BT, kv_layer_BSL=None, start_B=None, absorbed=False):
    """Self-attention sub-layer (input already normed). Returns (out [B,T,D], kv).

    Without a cache the chunk attends to itself (causal) and its new latents [B,T,C+R] are
    returned. With ``kv_layer_BSL`` (a contiguous [B,S,C+R] array or a paged layer) the new
    latents are written at ``start_B`` (rounded to the cache's dtype) and the chunk attends to
    the whole cached prefix, read back in the compute dtype; the updated layer cache is returned.
    """
    p = lp["attn"]
    cos, sin = mla.rope_cos_sin(cfg, q_pos_BT)
    q_res = mla.q_residual(p, cfg, x_BTD)
    q_nope, q_pe = mla.project_q(p, cfg, x_BTD, cos, sin, q_res)
    new_BTL = mla.project_kv_latent(p, cfg, x_BTD, cos, sin)
    if cfg.sparse_attention:                     # the indexer's key, cached beside the latent
        keys = dsa.index_keys(p["indexer"], cfg, x_BTD, cos, sin)
        new_BTL = jnp.concatenate([new_BTL, keys.astype(new_BTL.dtype)], axis=-1)
    if kv_layer_BSL is None:
        T = x_BTD.shape[1]
        kv = view = new_BTL
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (x_BTD.shape[0], T, T))
    else:
        if hasattr(kv_layer_BSL, "write_and_view"):      # paged: blocks + block tables
            kv, view = kv_layer_BSL.write_and_view(new_BTL, start_B)
        else:
            kv = view = write_rows(kv_layer_BSL, new_BTL, start_B)
        view = view.astype(x_BTD.dtype)          # stored in the cache dtype, read in the compute dtype
        mask = mla.causal_mask(q_pos_BT, view.shape[1])
    if cfg.sparse_attention and cfg.index_topk < view.shape[1]:       # else every key is selected
        scores = dsa.index_scores(p["indexer"], cfg, x_BTD, q_res, cos, sin, view[..., cfg.mla_latent_dim:], mask)
        if absorbed:                             # read only the selected rows
            return mla.output_proj(p, dsa.attend_sparse(p, cfg, q_nope, q_pe, view, *dsa.select(cfg, scores))), kv
        mask = dsa.sparse_mask(cfg, scores, mask)
    if absorbed:
        o = mla.attend_absorbed(p, cfg, q_nope, q_pe, view, mask)
    else:   # a chunk attending only to itself skips the fully masked upper score blocks
        blocks = CAUSAL_BLOCKS if kv_layer_BSL is None and x_BTD.shape[1] >= 128 else 1
        o = mla.attend_naive(p, cfg, q_nope, q_pe, view, mask, causal_blocks=blocks)
    return mla.output_proj(p, o), kv


def attention_block(lp, cfg: ModelConfig, x_BTD, q_pos_BT, kv_layer_BSL=None, start_B=None, absorbed=False):
    """The first half of a decoder layer: x + attn(norm(x)), x cast to ``cfg.compute_dtype``
    first (a no-op when it already is). Returns (x, kv) as :func:`attention` does."""
    x_BTD = x_BTD.astype(cfg.compute_dtype)
    h, kv = attention(lp, cfg, mla.rms_norm(x_BTD, lp["attn_norm"], cfg.rms_norm_eps), q_pos_BT,
                      kv_layer_BSL, start_B, absorbed)
    return x_BTD + h, kv


def layer(lp, cfg: ModelConfig, x_BTD, q_pos_BT, kv_layer_BSL=None, start_B=None,
          absorbed=False, moe_impl=None, valid_BT=None):
    """One decoder layer: x + attn(norm(x)) (:func:`attention_block`), then + ffn(norm(.)).
    Returns (x, kv)."""
    x_BTD, kv = attention_block(lp, cfg, x_BTD, q_pos_BT, kv_layer_BSL, start_B, absorbed)
    x_BTD = x_BTD + ffn(lp, cfg, mla.rms_norm(x_BTD, lp["ffn_norm"], cfg.rms_norm_eps), moe_impl, valid_BT)
    return x_BTD, kv


def embed(params, tokens, cfg: ModelConfig | None = None):
    """Embedding rows [..., D], in ``cfg.compute_dtype`` (the params' dtype without cfg)."""
    x = params["embed"][tokens]
    return x if cfg is None else x.astype(cfg.compute_dtype)


def head(params, cfg: ModelConfig, x):
    """Final RMSNorm and the LM head in the compute dtype, accumulated in float32: logits
    [..., V] float32."""
    return logits_of(params, final_hidden(params, cfg, x))


def final_hidden(params, cfg: ModelConfig, x):
    """The final RMSNorm of the last layer's output: what the head and MTP depth 1 read."""
    return mla.rms_norm(x.astype(cfg.compute_dtype), params["final_norm"], cfg.rms_norm_eps)


# ---- jitted cores ------------------------------------------------------------------------

def run_layers(params, cfg, x_BTD, q_pos_BT, kv_layers=None, start_B=None, absorbed=False,
               moe_impl=None, valid_BT=None):
    """All decoder layers. Returns (x, per-layer kv: the new latents without a cache, the
    updated layer caches with one). A MoE implementation with its own ``run_layers`` (e.g.
    dual-batch overlap, which interleaves two micro-batches) takes over the loop. Stacked
    params (:func:`pdjax.model.layer_scan.stack_layers`) run as one ``lax.scan`` per layer run,
    and their kv is per run (:func:`pdjax.model.layer_scan.run_layers`)."""
    x_BTD = x_BTD.astype(cfg.compute_dtype)
    if layer_scan.is_stacked(params):
        if hasattr(moe_impl, "run_layers"):
            raise ValueError(f"{type(moe_impl).__name__} runs its own layer loop over per-layer params; "
                             "stacked params (layer_runs) cannot use it: unstack_layers first")
        return layer_scan.run_layers(layer, params, cfg, x_BTD, q_pos_BT, kv_layers, start_B, absorbed,
                                     moe_impl, valid_BT)
    if hasattr(moe_impl, "run_layers"):
        return moe_impl.run_layers(params, cfg, x_BTD, q_pos_BT, kv_layers, start_B, absorbed, valid_BT)
    new_kv = []
    for l, lp in enumerate(params["layers"]):
        kv_l = None if kv_layers is None else kv_layers[l]
        x_BTD, kv = layer(lp, cfg, x_BTD, q_pos_BT, kv_l, start_B, absorbed, moe_impl, valid_BT)
        new_kv.append(kv)
    return x_BTD, new_kv


def forward_core(params, cfg, tokens_BT, moe_impl=None):
    """Unjitted full causal forward (no cache): logits [B,T,V] float32."""
    B, T = tokens_BT.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, _ = run_layers(params, cfg, embed(params, tokens_BT, cfg), q_pos, moe_impl=moe_impl)
    return head(params, cfg, x)


def _with_stats(core):
    """core -> a function returning (core's result, per-MoE-layer stats [layers] int32)."""
    @functools.wraps(core)
    def f(*args, **kwargs):
        with moe_lib.collect_stats() as stats:
            out = core(*args, **kwargs)
        return out, moe_lib.stacked_stats(stats)
    return f


_forward = jax.jit(_with_stats(forward_core), static_argnames=("cfg", "moe_impl"))


def run_with_cache(params, cfg, tokens_BT, cache, new_lengths_B, absorbed=False, moe_impl=None,
                   valid_BT=None):
    """Unjitted chunk through the model with a cache (prefill chunk or decode step)."""
    x, cache = chunk_core(params, cfg, tokens_BT, cache, new_lengths_B, absorbed, moe_impl, valid_BT)
    return head(params, cfg, x), cache


def chunk_core(params, cfg, tokens_BT, cache, new_lengths_B, absorbed=False, moe_impl=None, valid_BT=None):
    """:func:`run_with_cache` up to the last layer's output: (x [B,T,D], cache)."""
    start = cache.lengths
    q_pos = start[:, None] + jnp.arange(tokens_BT.shape[1], dtype=jnp.int32)[None, :]
    x, new_kv = run_layers(params, cfg, embed(params, tokens_BT, cfg), q_pos, cache.layers(), start, absorbed,
                           moe_impl, valid_BT)
    return x, cache.with_layers(new_kv, start + new_lengths_B)


@functools.partial(jax.jit, static_argnames=("cfg", "absorbed", "moe_impl"), donate_argnames=("cache",))
@_with_stats
def _prefill(params, cfg, tokens_BT, cache, lengths_B, absorbed=False, moe_impl=None):
    return run_with_cache(params, cfg, tokens_BT, cache, lengths_B, absorbed, moe_impl,
                          _valid(tokens_BT.shape[1], lengths_B))


def _valid(T, lengths_B):
    """[B,T] True for a row's real tokens, False for the padding after its length."""
    return jnp.arange(T, dtype=jnp.int32)[None, :] < lengths_B[:, None]


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "absorbed", "moe_impl"))
@_with_stats
def _prefill_fresh(params, cfg, tokens_BT, lengths_B, max_len, absorbed=False, moe_impl=None):
    x, cache = fresh_core(params, cfg, tokens_BT, lengths_B, max_len, absorbed, moe_impl)
    return head(params, cfg, x), cache


def fresh_core(params, cfg, tokens_BT, lengths_B, max_len, absorbed=False, moe_impl=None):
    """Prefill into a new cache: the chunk attends to itself only (nothing is cached yet), and
    its latents are then laid into a cache of max_len positions. (x [B,T,D], cache)."""
    B, T = tokens_BT.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, new_kv = run_layers(params, cfg, embed(params, tokens_BT, cfg), q_pos, None, None, absorbed, moe_impl,
                           _valid(T, lengths_B))
    if layer_scan.is_stacked(params):
        return x, layer_scan.fresh_cache(new_kv, lengths_B, max_len, cfg)
    kv = tuple(jnp.pad(to_cache_dtype(k, cfg.kv_cache_dtype), ((0, 0), (0, max_len - T), (0, 0)))
               for k in new_kv)
    return x, KVCache(kv=kv, lengths=lengths_B.astype(jnp.int32))


def decode_core(params, cfg, tokens_B, cache, moe_impl=None, valid_B=None):
    """Unjitted decode step: one token per row, absorbed MLA. (logits [B,V], cache).
    ``valid_B``: False for rows that are empty slots (padding, kept off the experts)."""
    logits, cache = run_with_cache(params, cfg, tokens_B[:, None], cache,
                                    jnp.ones_like(cache.lengths), True, moe_impl,
                                    None if valid_B is None else valid_B[:, None])
    return logits[:, 0], cache


_decode_step = jax.jit(_with_stats(decode_core), static_argnames=("cfg", "moe_impl"),
                       donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "moe_impl"), donate_argnames=("cache",))
def _greedy_loop(params, cfg, first_B, cache, steps, moe_impl=None):
    def body(carry, _):
        tok, cache = carry
        (logits, cache), stats = _with_stats(decode_core)(params, cfg, tok, cache, moe_impl)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (nxt, cache), (nxt, stats)
    (_, cache), (toks, stats) = jax.lax.scan(body, (first_B, cache), None, length=steps)
    return (toks.T, cache), stats.sum(0)


# ---- public API ----------------------------------------------------------------------------

def _place(x, batch_sharding):
    """Put batch-major arrays (tokens, cache buffers, lengths) onto the mesh, if one is used."""
    return x if batch_sharding is None else jax.device_put(x, batch_sharding)


def _finish(result, stats, moe_impl, return_stats: bool, what: str):
    """Report dropped assignments (never silent) and optionally return the stats."""
    if getattr(moe_impl, "may_drop", False):
        dropped = np.asarray(stats)
        if dropped.sum() > 0:
            warnings.warn(f"{what}: capacity-limited expert parallelism dropped "
                          f"{int(dropped.sum())} token-expert assignments (per MoE layer: "
                          f"{dropped.tolist()}); raise capacity_factor or use None (dropless)",
                          stacklevel=3)
    if return_stats:
        return result, {"dropped_per_moe_layer": stats}
    return result


def forward(params, cfg: ModelConfig, tokens, *, moe_impl=None, batch_sharding=None,
            return_stats: bool = False):
    """Logits [B,T,V] (float32) of a full causal forward, no cache.

    ``moe_impl``: "bucketed", "tiled", "ragged" or a MoE callable (expert parallelism);
    ``batch_sharding``: where batch-major inputs go (a mesh's DP sharding);
    ``return_stats``: also return {"dropped_per_moe_layer": [moe layers]}.
    """
    tokens = check_tokens(cfg, tokens, 2)
    check_layers(params, cfg, None, moe_impl)
    if not is_tracer(tokens) and tokens.shape[1] > cfg.max_position_embeddings:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    logits, stats = _forward(params, cfg, _place(tokens, batch_sharding), moe_impl)
    return _finish(logits, stats, moe_impl, return_stats, "forward")


def prefill(params, cfg: ModelConfig, tokens, *, max_len: int | None = None,
            cache: KVCache | None = None, lengths=None, absorbed: bool = False, moe_impl=None,
            batch_sharding=None, return_stats: bool = False):
    """Run a prompt chunk [B,T] through the model, writing its latents into the cache.

    * ``cache=None``: a new cache of ``max_len`` (default T) positions is made.
    * with ``cache``: the chunk continues each row at ``cache.lengths`` and attends to the
      cached prefix (chunked prefill). The given cache is donated.
    * ``lengths [B]`` (optional): valid tokens per row for right-padded ragged prompts.
    Returns (logits [B,T,V] float32, cache).
    """
    tokens = check_tokens(cfg, tokens, 2)
    check_layers(params, cfg, cache, moe_impl)
    if max_len is not None:
        max_len = check_int("max_len", max_len)
    B, T = tokens.shape
    fresh = cache is None
    if fresh:
        max_len = T if max_len is None else max_len
        if T > max_len:
            raise ValueError(f"prompt of {T} tokens is longer than max_len={max_len}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        lengths = check_lengths(lengths, B, T)
        out, stats = _prefill_fresh(params, cfg, _place(tokens, batch_sharding),
                                    _place(jnp.asarray(lengths), batch_sharding), max_len, absorbed, moe_impl)
        if not on_device(lengths):
            remember_lengths(out[1].lengths, lengths)
        return _finish(out, stats, moe_impl, return_stats, "prefill")
    if max_len is not None and max_len != cache.max_len:
        raise ValueError(f"max_len={max_len} disagrees with the given cache ({cache.max_len})")
    if cache.batch != B:
        raise ValueError(f"tokens batch {B} does not match cache batch {cache.batch}")
    lengths = check_lengths(lengths, B, T)
    start = host_lengths(cache.lengths)           # None: a device array the host has no copy of
    if start is not None and start.max() + T > cache.max_len:
        raise ValueError(f"prompt of {T} tokens after a cached prefix of "
                         f"{int(start.max())} exceeds max_len={cache.max_len}")
    out, stats = _prefill(params, cfg, _place(tokens, batch_sharding), cache,
                          _place(jnp.asarray(lengths), batch_sharding), absorbed, moe_impl)
    if start is not None and not on_device(lengths):
        remember_lengths(out[1].lengths, start + lengths)
    return _finish(out, stats, moe_impl, return_stats, "prefill")


def decode_step(params, cfg: ModelConfig, next_tokens, cache: KVCache, *, moe_impl=None,
                batch_sharding=None, return_stats: bool = False):
    """One token per row [B] -> (logits [B,V] float32, cache). Absorbed MLA; cache donated.

    Nothing here waits for the device (see the module docstring): ``next_tokens`` may be the
    previous step's ``argmax`` still being computed. The full-cache check uses the lengths the
    host recorded for caches made by init_cache / prefill / decode_step; a cache whose device
    lengths were made elsewhere is checked for shape only."""
    next_tokens = check_tokens(cfg, next_tokens, 1, "next_tokens")
    check_cache(cache, cfg)                      # required here
    check_layers(params, cfg, cache, moe_impl)
    if next_tokens.shape[0] != cache.batch:
        raise ValueError(f"next_tokens batch {next_tokens.shape[0]} does not match cache batch {cache.batch}")
    start = host_lengths(cache.lengths)
    if start is not None and start.max() >= cache.max_len:
        raise ValueError(f"cache is full: a row already holds max_len={cache.max_len} tokens")
    out, stats = _decode_step(params, cfg, _place(next_tokens, batch_sharding), cache, moe_impl)
    if start is not None:
        remember_lengths(out[1].lengths, start + 1)
    return _finish(out, stats, moe_impl, return_stats, "decode_step")


def generate(params, cfg: ModelConfig, prompts, *, max_new_tokens: int, max_len: int | None = None,
             moe_impl=None, batch_sharding=None):
    """Greedy generation.

    ``prompts``: an int array [B,T] (returns an array [B, T+max_new_tokens]) or a list of
    token lists of any lengths (returns a list of the new token lists, one per prompt, as every
    serving engine's ``generate`` does).
    """
    check_int("max_new_tokens", max_new_tokens)
    if max_len is not None:
        max_len = check_int("max_len", max_len)
    check_layers(params, cfg, None, moe_impl)
    tokens, lengths, ragged = pad_prompts(cfg, prompts)
    need = int(lengths.max()) + max_new_tokens
    max_len = need if max_len is None else max_len
    if need > max_len:
        raise ValueError(f"prompt ({int(lengths.max())}) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds max_len={max_len}")
    logits, cache = prefill(params, cfg, tokens, max_len=max_len, lengths=lengths, moe_impl=moe_impl,
                            batch_sharding=batch_sharding)
    first = jnp.argmax(logits[jnp.arange(tokens.shape[0]), jnp.asarray(lengths) - 1], -1).astype(jnp.int32)
    new = np.asarray(first)[:, None]
    if max_new_tokens > 1:
        (rest, _), stats = _greedy_loop(params, cfg, _place(first, batch_sharding), cache,
                                        max_new_tokens - 1, moe_impl)
        _finish(None, stats, moe_impl, False, "generate")
        new = np.concatenate([new, np.asarray(rest)], axis=1)
    if ragged:
        return [new[i].tolist() for i in range(len(prompts))]
    return np.concatenate([tokens.astype(np.int32), new], axis=1)
