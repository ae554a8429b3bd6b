"""DeepSeek-V3.2's sparse attention (DSA): the lightning indexer and top-k sparse MLA.

In every layer a small indexer scores each query against every earlier token and the MLA
attention then reads only the ``index_topk`` best (all of them when there are no more).
As transformers' ``DeepseekV32Indexer`` defines it, for a query at t and a key at s:

    q_i      = wq_b(q_resid)_t                      [Hi, Di]  (q_resid: the query's LoRA
                                                               residual, RMSNorm(x wq_a))
    k        = LayerNorm(x_s wk)                    [Di]      (weight and bias, eps 1e-6)
               the first qk_rope_head_dim dims of both rotated with RoPE in the half-split
               layout (x1 cos - x2 sin | x2 cos + x1 sin), not MLA's interleaved pairs
    w        = (x_t weights_proj) * Hi^-1/2         [Hi]      (float32)
    score    = sum_h w_h * relu(q_h . k * Di^-1/2)            (float32), -inf where s > t
    selected = lax.top_k(score, min(index_topk, S))

The key ``k`` of every token is cached beside its MLA latent: a cached row is
``[RMSNorm(latent) | RoPE(k_pe) | indexer key]`` (``cfg.kv_latent_dim`` wide; MLA reads the
first ``cfg.mla_latent_dim``), so every cache, handoff and prefix store carries it.

Two forms, as the rest of MLA: prefill (naive) masks the scores of the unselected keys
(:func:`sparse_mask`, exact to transformers' additive mask); decode (absorbed) gathers
only the selected rows and attends over them (:func:`attend_sparse`): its reads grow with
min(context, index_topk), the indexer's with the context at its small width. Ties in the
top-k resolve as ``lax.top_k`` does (the lower index first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.model_config import ModelConfig
from pdjax.model import dots
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare

#: the indexer key's LayerNorm epsilon (transformers' and DeepSeek's)
KEY_NORM_EPS = 1e-6


def indexer_weights(cfg: ModelConfig, key, dtype) -> dict:
    """One layer's indexer weights with their logical axes: wq_b [Q, Hi, Di], wk [D, Di],
    k_norm / k_norm_bias [Di], weights_proj [D, Hi] (float32, as transformers keeps it)."""
    Q, D, Hi, Di = cfg.q_lora_rank, cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    ks = jax.random.split(key, 3)
    return {"wq_b": declare(scaled_normal(ks[0], (Q, Hi, Di), Q ** -0.5, dtype), ("q_lora", None, None)),
            "wk": declare(scaled_normal(ks[1], (D, Di), D ** -0.5, dtype), ("embed", None)),
            "k_norm": declare(jnp.ones((Di,), dtype), (None,)),
            "k_norm_bias": declare(jnp.zeros((Di,), dtype), (None,)),
            "weights_proj": declare(scaled_normal(ks[2], (D, Hi), D ** -0.5, jnp.float32), ("embed", None))}


def _layer_norm(x, weight, bias):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + KEY_NORM_EPS)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rope_half(x, cos, sin):
    """RoPE on the first 2 * cos.shape[-1] dims of x [B,T,...,Di] in the half-split layout;
    cos/sin [B,T,R/2] (:func:`pdjax.model.mla.rope_cos_sin`, YaRN's factor included)."""
    half = cos.shape[-1]
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(cos.shape)
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(x.dtype)


def index_keys(p, cfg: ModelConfig, x_BTD, cos, sin):
    """The indexer keys of new tokens [B,T,Di] (what the cache keeps beside the latent)."""
    return _rope_half(_layer_norm(dots.matmul(x_BTD, p["wk"]), p["k_norm"], p["k_norm_bias"]), cos, sin)


def index_scores(p, cfg: ModelConfig, x_BTD, q_resid_BTQ, cos, sin, keys_BSI, mask_BTS):
    """The indexer's score of every (query, key) pair [B,T,S] float32, -inf where masked."""
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    q_BTHI = _rope_half(dots.einsum("BTQ,QHI->BTHI", q_resid_BTQ, p["wq_b"]), cos, sin)
    s_BTHS = jnp.einsum("BTHI,BSI->BTHS", q_BTHI.astype(jnp.float32), keys_BSI.astype(jnp.float32),
                        preferred_element_type=jnp.float32) * Di ** -0.5
    w_BTH = jnp.einsum("BTD,DH->BTH", x_BTD.astype(jnp.float32), p["weights_proj"].astype(jnp.float32),
                       preferred_element_type=jnp.float32) * Hi ** -0.5
    scores = jnp.einsum("BTH,BTHS->BTS", w_BTH, jax.nn.relu(s_BTHS))
    return jnp.where(mask_BTS, scores, -jnp.inf)


def select(cfg: ModelConfig, scores_BTS):
    """(indices [B,T,k], valid [B,T,k]) of each query's top k = min(index_topk, S) keys;
    ``valid``: the key was allowed (a query with fewer than k earlier tokens gets some masked ones)."""
    k = min(cfg.index_topk, scores_BTS.shape[-1])
    top, idx = jax.lax.top_k(scores_BTS, k)
    return idx, top > -jnp.inf


def sparse_mask(cfg: ModelConfig, scores_BTS, mask_BTS):
    """``mask_BTS`` restricted to each query's selected keys (naive MLA, prefill)."""
    idx, _ = select(cfg, scores_BTS)
    B, T, _ = idx.shape
    chosen = jnp.zeros(scores_BTS.shape, bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                                  idx].set(True)
    return mask_BTS & chosen


def attend_sparse(p, cfg: ModelConfig, q_nope, q_pe, kv_BSW, idx_BTK, valid_BTK):
    """Absorbed MLA over only the selected cached rows: each query gathers its k rows
    [k, W] (W = ``cfg.kv_latent_dim``; the indexer key's columns meet zeros in the query)
    and attends over them. Returns [B,T,H,V]."""
    B, T, H, _ = q_nope.shape
    C, W = cfg.kv_lora_rank, kv_BSW.shape[-1]
    # one gather of the selected rows (top_k's indices are in bounds: no clamping pass)
    rows_BTKW = kv_BSW.at[jnp.arange(B)[:, None, None], idx_BTK].get(mode="promise_in_bounds")
    q_lat = dots.einsum("BTHK,CHK->BTHC", q_nope, p["wk_b"])
    q_BTHW = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype),
                              jnp.zeros((B, T, H, W - cfg.mla_latent_dim), q_lat.dtype)], axis=-1)
    scores = jnp.einsum("BTHW,BTKW->BTHK", q_BTHW, rows_BTKW, preferred_element_type=jnp.float32)
    scores = jnp.where(valid_BTK[:, :, None], scores * cfg.softmax_scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(kv_BSW.dtype)
    o_BTHW = jnp.einsum("BTHK,BTKW->BTHW", probs, rows_BTKW, preferred_element_type=jnp.float32)
    return dots.einsum("BTHC,CHV->BTHV", o_BTHW[..., :C].astype(kv_BSW.dtype), p["wv_b"])


# ---- checkpoints: transformers' names (model.layers.{i}.self_attn.indexer.*) ------------------

def indexer_tensors(cfg: ModelConfig, prefix: str) -> dict:
    """The indexer's tensors of one layer in a Hugging Face checkpoint: {name: shape}."""
    Q, D, Hi, Di = cfg.q_lora_rank, cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return {prefix + "wq_b.weight": (Hi * Di, Q), prefix + "wk.weight": (Di, D), prefix + "k_norm.weight": (Di,),
            prefix + "k_norm.bias": (Di,), prefix + "weights_proj.weight": (Hi, D)}


def indexer_from_hf(cfg: ModelConfig, get, prefix: str, leaf) -> dict:
    """The indexer's params from a checkpoint getter (``get(name) -> array``, HF layout)."""
    Q, Hi, Di = cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    return {"wq_b": leaf(lambda: get(prefix + "wq_b.weight").T.reshape(Q, Hi, Di)),
            "wk": leaf(lambda: get(prefix + "wk.weight").T),
            "k_norm": leaf(lambda: get(prefix + "k_norm.weight")),
            "k_norm_bias": leaf(lambda: get(prefix + "k_norm.bias")),
            "weights_proj": leaf(lambda: get(prefix + "weights_proj.weight").T)}


def indexer_to_hf(p, prefix: str) -> dict:
    """The inverse of :func:`indexer_from_hf`: {HF name: array}."""
    return {prefix + "wq_b.weight": p["wq_b"].reshape(p["wq_b"].shape[0], -1).T, prefix + "wk.weight": p["wk"].T,
            prefix + "k_norm.weight": p["k_norm"], prefix + "k_norm.bias": p["k_norm_bias"],
            prefix + "weights_proj.weight": p["weights_proj"].T}
