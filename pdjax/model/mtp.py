"""DeepSeek-V3's multi-token prediction (MTP) modules (``cfg.num_nextn_predict_layers`` of
them, ``params["mtp"]``, one dict per depth).

Depth k (1-based) at position i predicts token i+k+1. Its input is the previous depth's
hidden state at i and the embedding of token i+k::

    x_i  = eh_proj([enorm(embed(t[i+k])) ; hnorm(g[k-1][i])])     # embedding first
    y    = one decoder block (MLA + MoE, the layer index num_hidden_layers + k - 1), positions i
    g[k] = shared_head norm(y);   logits = g[k] @ lm_head               # head shared with the model

``g[0]`` is the main model's last hidden state after its final norm (the state its head
reads). The DeepSeek-V3 report (arXiv 2412.19437, eq. 21) writes the concatenation with the
hidden state first; the implementations that read the released weights (vLLM's
``deepseek_mtp.py``, SGLang's ``deepseek_nextn.py``, Megatron-LM's
``multi_token_prediction.py``) put the embedding first, and all three feed the depth the
normed states (the main model's output after ``model.norm``, a depth's output after its
``shared_head.norm``): that is what is built here. The embedding and the output head are
the main model's (``params["embed"]``, ``params["lm_head"]``); a V3 checkpoint's copies of
them in its MTP layer are checked equal on loading.

Params of one depth: ``enorm`` [D], ``hnorm`` [D], ``eh_proj`` [2D, D] (rows 0..D-1 act on
the embedding), ``layer`` (a decoder layer's params), ``head_norm`` [D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.model_config import ModelConfig
from pdjax.model import dots, mla
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare

#: the MTP weights' key in a params tree, beside "embed", "layers", "final_norm", "lm_head"
MTP = "mtp"
_FOLD = 0x4D5450            # the init key of the MTP modules: folded from the params' key


def check_speculative(params, cfg: ModelConfig, speculative) -> None:
    """Raise ValueError unless ``speculative`` is None, or "mtp" with an MTP module in the
    config (``num_nextn_predict_layers`` >= 1) and in ``params``: before any compute."""
    if speculative is None:
        return
    if speculative != "mtp":
        raise ValueError(f"speculative must be None or 'mtp', got {speculative!r}")
    if not getattr(cfg, "num_nextn_predict_layers", 0) or not isinstance(params, dict) or not params.get(MTP):
        raise ValueError("speculative='mtp' needs an MTP module: cfg.num_nextn_predict_layers >= 1 and "
                         f"params['{MTP}'] (this config has num_nextn_predict_layers="
                         f"{getattr(cfg, 'num_nextn_predict_layers', None)})")


def mtp_weights(cfg: ModelConfig, key, dtype, layer_weights) -> list:
    """The MTP modules' weights with their logical axes (``layer_weights(cfg, index, key,
    dtype)`` makes a decoder layer's); [] when ``cfg.num_nextn_predict_layers`` is 0. Made
    from their own key (folded from ``key``), so the main model's params are the same with
    or without them."""
    D = cfg.hidden_size
    out = []
    keys = jax.random.split(jax.random.fold_in(key, _FOLD), max(cfg.num_nextn_predict_layers, 1))
    for j in range(cfg.num_nextn_predict_layers):
        k_proj, k_layer = jax.random.split(keys[j])
        out.append({"enorm": declare(jnp.ones((D,), dtype), ("embed",)),
                    "hnorm": declare(jnp.ones((D,), dtype), ("embed",)),
                    "eh_proj": declare(scaled_normal(k_proj, (2 * D, D), (2 * D) ** -0.5, dtype), (None, "embed")),
                    "layer": layer_weights(cfg, cfg.num_hidden_layers + j, k_layer, dtype),
                    "head_norm": declare(jnp.ones((D,), dtype), ("embed",))})
    return out


def depth_input(p, cfg: ModelConfig, emb_BTD, g_BTD):
    """eh_proj([enorm(emb); hnorm(g)]): one depth's input to its decoder block."""
    cd = cfg.compute_dtype
    e = mla.rms_norm(emb_BTD.astype(cd), p["enorm"], cfg.rms_norm_eps)
    h = mla.rms_norm(g_BTD.astype(cd), p["hnorm"], cfg.rms_norm_eps)
    return jnp.concatenate([e, h], axis=-1) @ p["eh_proj"].astype(cd)


def depth_block(p, cfg: ModelConfig, emb_BTD, g_BTD, q_pos_BT, layer, kv_layer=None, start_B=None,
                absorbed=False, moe_impl=None, valid_BT=None):
    """One depth: (its normed output g [B,T,D], the block's kv as ``layer`` returns it).
    ``layer``: the decoder layer function (:func:`pdjax.model.transformer.layer`)."""
    x = depth_input(p, cfg, emb_BTD, g_BTD)
    y, kv = layer(p["layer"], cfg, x, q_pos_BT, kv_layer, start_B, absorbed, moe_impl, valid_BT)
    return mla.rms_norm(y.astype(cfg.compute_dtype), p["head_norm"], cfg.rms_norm_eps), kv


def mtp_logits(params, cfg: ModelConfig, g_BTD, tokens_BT, layer, moe_impl=None) -> list:
    """Every depth's logits over a whole sequence (training, no cache): depth k's are
    [B, T-k, V], position i predicting token i+k+1 (its last position has no target).
    ``g_BTD``: the main model's normed hidden states
    (:func:`pdjax.model.transformer.final_hidden`)."""
    out = []
    B, T = tokens_BT.shape
    for k, p in enumerate(params[MTP], start=1):
        emb = params["embed"][tokens_BT[:, k:]]
        q_pos = jnp.broadcast_to(jnp.arange(T - k, dtype=jnp.int32), (B, T - k))
        g_BTD, _ = depth_block(p, cfg, emb, g_BTD[:, :T - k], q_pos, layer, moe_impl=moe_impl)
        out.append(dots.logits_of(params, g_BTD))
    return out
