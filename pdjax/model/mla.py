"""Multi-head latent attention (MLA), exactly as DeepSeek-V2/V3.

Einsum legend:
  B batch, T query positions, S key positions, D hidden, H heads, Q q-LoRA rank,
  C kv_lora_rank (latent), R qk_rope_head_dim, K qk_nope_head_dim, V v_head_dim,
  L cached width per token = C + R (latent | rope key).

The cache stores, per token and layer, only ``[RMSNorm(c_kv) | RoPE(k_pe)]`` (C + R values).
Two equivalent attention paths read it:
  * ``naive``: expand the latent through W_UK / W_UV to per-head keys and values (the
    reference, used by prefill);
  * ``absorbed``: fold W_UK into the query (q_nope W_UK^T is a C-vector per head) and W_UV
    into the output, and attend directly over the cached [latent | rope key] rows with a
    single (C + R)-wide dot product (decode).

Precision: inputs arrive in the compute dtype and every weight is cast to the input's dtype
where it is used; RMSNorm, RoPE, the scores (accumulated in float32) and the softmax run in
float32, the probabilities are cast back before they weight the values (the absorbed path
weights them unnormalised, accumulates in float32 and divides by their sum afterwards).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.model_config import ModelConfig, yarn_mscale
from pdjax.model import dots, dsa
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare, values


# q_a_layernorm and kv_a_layernorm are built with the default eps in DeepSeek's reference and
# in transformers, not config.rms_norm_eps (equal in every published config).
LATENT_NORM_EPS = 1e-6
_INDEXER_FOLD = 0x445341        # the sparse-attention indexer's init key, folded from the layer's


def rms_norm(x, weight, eps):
    """RMSNorm in float32, cast back to x.dtype before the scale (as HF does); the result is
    in x.dtype (the weight is cast to it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


# ---- RoPE / YaRN ------------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [R/2] (float64, host side), with YaRN when configured.

    YaRN: frequencies whose wavelength is short against the original context keep their
    value (extrapolate), long ones are divided by ``factor`` (interpolate), with a linear
    ramp between the correction dims floor(d(beta_fast)) .. ceil(d(beta_slow)), where
    d(n) = R * ln(orig_len / (2 pi n)) / (2 ln theta).
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq

    def correction_dim(num_rotations):
        return dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp
    return inv_freq / rs.factor * (1.0 - extrapolate) + inv_freq * extrapolate


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN multiplies cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    denom = yarn_mscale(rs.factor, rs.mscale_all_dim) if rs.mscale_all_dim else 1.0
    return yarn_mscale(rs.factor, rs.mscale) / denom


def rope_cos_sin(cfg: ModelConfig, positions):
    """cos, sin [..., R/2] in float32 for integer positions [...]."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    m = rope_attention_factor(cfg)
    return jnp.cos(angles) * m, jnp.sin(angles) * m


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last axis, as DeepSeek does.

    x: [B, T, ..., R]; cos/sin: [B, T, R/2] broadcast over the middle axes.
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * (extra) + cos.shape[2:])
    sin = sin.reshape(cos.shape)
    xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


# ---- projections ----------------------------------------------------------------------

def q_residual(p, cfg: ModelConfig, x_BTD):
    """The query's LoRA residual RMSNorm(x wq_a) [B,T,Q] (None without a q LoRA); the
    sparse-attention indexer reads it too."""
    if cfg.q_lora_rank is None:
        return None
    return rms_norm(dots.matmul(x_BTD, p["wq_a"]), p["q_norm"], LATENT_NORM_EPS)


def project_q(p, cfg: ModelConfig, x_BTD, cos, sin, q_BTQ=None):
    """Queries [B,T,H,K] (no-position part) and [B,T,H,R] (rotated). ``q_BTQ``: the
    :func:`q_residual` when already computed."""
    if cfg.q_lora_rank is None:
        q_BTHK = dots.einsum("BTD,DHK->BTHK", x_BTD, p["wq"])
    else:
        q_BTQ = q_residual(p, cfg, x_BTD) if q_BTQ is None else q_BTQ
        q_BTHK = dots.einsum("BTQ,QHK->BTHK", q_BTQ, p["wq_b"])
    q_nope, q_pe = jnp.split(q_BTHK, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rope(q_pe, cos, sin)


def project_kv_latent(p, cfg: ModelConfig, x_BTD, cos, sin):
    """The cache entry of each new token: [RMSNorm(latent) | RoPE(k_pe)], shape [B,T,C+R]."""
    kv_BTL = dots.matmul(x_BTD, p["wkv_a"])
    c_BTC, k_pe_BTR = jnp.split(kv_BTL, [cfg.kv_lora_rank], axis=-1)
    c_BTC = rms_norm(c_BTC, p["kv_norm"], LATENT_NORM_EPS)
    return jnp.concatenate([c_BTC, apply_rope(k_pe_BTR, cos, sin)], axis=-1)


# ---- attention ------------------------------------------------------------------------

def _masked_softmax(scores_BHTS, mask_BTS):
    scores = jnp.where(mask_BTS[:, None], scores_BHTS.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def attend_naive(p, cfg: ModelConfig, q_nope, q_pe, kv_BSL, mask_BTS, causal_blocks: int = 1):
    """Reference MLA: per-head keys/values expanded from the latent. Returns [B,T,H,V].

    Heads sit next to the batch (B,H leading) so the attention GEMMs are plain batched
    matmuls. The scores are two dots summed: each head's query against its own key (K wide)
    and its rope query against the rope key that all heads share (R wide, read as it is), so
    the shared key is never broadcast to every head and joined to its keys (those copies cost
    8-12 % of a float32 prefill on XLA:CPU).
    ``causal_blocks`` = n > 1 (only for a chunk attending to itself, S == T, causal): query
    block i attends to keys [0, (i+1)T/n) only, skipping the fully masked upper blocks
    ((n-1)/2n of the score and softmax work); the result is the same."""
    c_BSC, k_pe_BSR = kv_BSL[..., :cfg.kv_lora_rank], kv_BSL[..., cfg.kv_lora_rank:cfg.mla_latent_dim]
    k_nope_BHSK = dots.einsum("BSC,CHK->BHSK", c_BSC, p["wk_b"])
    v_BHSV = dots.einsum("BSC,CHV->BHSV", c_BSC, p["wv_b"])
    k_pe_BSR = k_pe_BSR.astype(k_nope_BHSK.dtype)
    q_BHTK = q_nope.transpose(0, 2, 1, 3)
    q_pe_BHTR = q_pe.astype(q_nope.dtype).transpose(0, 2, 1, 3)
    T = q_BHTK.shape[2]
    n = causal_blocks if causal_blocks > 1 and T % causal_blocks == 0 and T == k_nope_BHSK.shape[2] else 1
    bt = T // n
    outs = []
    for i in range(n):
        S_i = k_nope_BHSK.shape[2] if n == 1 else (i + 1) * bt
        rows = slice(i * bt, (i + 1) * bt)
        scores = (jnp.einsum("BHTK,BHSK->BHTS", q_BHTK[:, :, rows], k_nope_BHSK[:, :, :S_i],
                             preferred_element_type=jnp.float32)
                  + jnp.einsum("BHTR,BSR->BHTS", q_pe_BHTR[:, :, rows], k_pe_BSR[:, :S_i],
                               preferred_element_type=jnp.float32))
        probs = _masked_softmax(scores * cfg.softmax_scale, mask_BTS[:, rows, :S_i])
        outs.append(jnp.einsum("BHTS,BHSV->BHTV", probs.astype(v_BHSV.dtype), v_BHSV[:, :, :S_i]))
    return jnp.concatenate(outs, axis=2).transpose(0, 2, 1, 3)


def attend_absorbed(p, cfg: ModelConfig, q_nope, q_pe, kv_BSL, mask_BTS):
    """Absorbed MLA: W_UK folded into q, W_UV applied after attending over the latent.

    One (C+R)-wide dot per (query, cached token, head); the cache is never expanded.
    Returns [B,T,H,V].

    Shaped for memory traffic (decode's cost is reading the cache): the T*H query rows of a
    batch row form one axis N, the mask enters as an additive bias, so the score dot, the
    bias, the row max and the exponentials fuse (the float32 scores are never written);
    the exponentials ``e`` [B,N,S], rounded to the cache's dtype, are the only per-head
    array in memory, read by the row sums and by the value dot; the value dot accumulates in
    float32 and the small [B,N,C] result is divided by the sums (softmax normalised last,
    the same weights in the numerator and the denominator).
    """
    B, T, H, _ = q_nope.shape
    C, N = cfg.kv_lora_rank, T * H
    q_lat_BTHC = dots.einsum("BTHK,CHK->BTHC", q_nope, p["wk_b"])
    # a sparse-attention row also holds the indexer's key: it meets zeros in the query
    pad = jnp.zeros((B, T, H, kv_BSL.shape[-1] - cfg.mla_latent_dim), q_lat_BTHC.dtype)
    q_BNL = jnp.concatenate([q_lat_BTHC, q_pe.astype(q_lat_BTHC.dtype), pad], axis=-1).reshape(B, N, -1)
    # The mask and scale are the same in every layer; tied to this layer's queries, the
    # [B,N,S] broadcasts of both stay inside this layer's score fusion (XLA:CPU otherwise
    # shares one materialised [B,N,S] array of each between layers: two more passes apiece).
    bias_BTS = jnp.where(mask_BTS, 0.0, -jnp.inf).astype(jnp.float32)
    q_BNL, bias_BTS, scale = jax.lax.optimization_barrier((q_BNL, bias_BTS, jnp.float32(cfg.softmax_scale)))
    bias_BNS = jnp.broadcast_to(bias_BTS[:, :, None], (B, T, H, kv_BSL.shape[1])).reshape(B, N, -1)
    scores = jnp.einsum("BNL,BSL->BNS", q_BNL, kv_BSL, preferred_element_type=jnp.float32)
    scores = scores * scale + bias_BNS
    e_BNS = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)).astype(kv_BSL.dtype)
    denom_BN1 = jnp.sum(e_BNS, axis=-1, keepdims=True, dtype=jnp.float32)
    # Attend over the full cached rows and drop the rope columns of the small result: slicing
    # the latent out of the cache first would copy the cache.
    o_BNL = jnp.einsum("BNS,BSL->BNL", e_BNS, kv_BSL, preferred_element_type=jnp.float32)
    o_BTHC = (o_BNL[..., :C] / denom_BN1).astype(kv_BSL.dtype).reshape(B, T, H, C)
    return dots.einsum("BTHC,CHV->BTHV", o_BTHC, p["wv_b"])


def output_proj(p, o_BTHV):
    return dots.einsum("BTHV,HVD->BTD", o_BTHV, p["wo"])


def causal_mask(q_pos_BT, kv_len_S):
    """mask[b,t,s] = key position s <= query position q_pos[b,t]."""
    return jnp.arange(kv_len_S)[None, None, :] <= q_pos_BT[:, :, None]


def attention_weights(cfg: ModelConfig, key, dtype) -> dict:
    """One layer's attention weights, each with its logical axes
    (:func:`pdjax.model.sharding.declare`)."""
    H, D, C, R = cfg.num_attention_heads, cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    K, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    ks = jax.random.split(key, 6)

    def dense(k, shape, fan_in, axes):
        return declare(scaled_normal(k, shape, fan_in ** -0.5, dtype), axes)

    p = {}
    if cfg.q_lora_rank is None:
        p["wq"] = dense(ks[0], (D, H, K + R), D, ("embed", "heads", None))
    else:
        Q = cfg.q_lora_rank
        p["wq_a"] = dense(ks[0], (D, Q), D, ("embed", "q_lora"))
        p["q_norm"] = declare(jnp.ones((Q,), dtype), ("q_lora",))
        p["wq_b"] = dense(ks[1], (Q, H, K + R), Q, ("q_lora", "heads", None))
    p["wkv_a"] = dense(ks[2], (D, C + R), D, ("embed", None))            # [latent | rope key]
    p["kv_norm"] = declare(jnp.ones((C,), dtype), ("latent",))
    p["wk_b"] = dense(ks[3], (C, H, K), C, ("latent", "heads", None))
    p["wv_b"] = dense(ks[4], (C, H, V), C, ("latent", "heads", None))
    p["wo"] = dense(ks[5], (H, V, D), H * V, ("heads", None, "embed"))
    if cfg.sparse_attention:                     # DeepSeek-V3.2's indexer, from its own key
        p["indexer"] = dsa.indexer_weights(cfg, jax.random.fold_in(key, _INDEXER_FOLD), dtype)
    return p


def init_attention(cfg: ModelConfig, key, dtype):
    """One layer's attention params (:func:`attention_weights` without the axes)."""
    return values(attention_weights(cfg, key, dtype))
