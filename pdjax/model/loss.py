"""The training loss, ``pdjax.loss``: the mean next-token cross-entropy of the model, plus
``mtp_weight`` (the DeepSeek-V3 report's lambda) times the mean over the MTP depths of each
depth's mean cross-entropy (:mod:`pdjax.model.mtp`).

Over a batch [B,T]: the model's term averages -log p(token[t+1]) over the B (T-1)
predictions; depth k's over its B (T-1-k) (position i predicts token i+k+1; the report
divides its sum by T instead, Megatron-LM by the predictions made, as here). So a sequence
needs T >= num_nextn_predict_layers + 2 tokens when ``mtp_weight`` > 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax import model_config_checks
from pdjax.model_config import ModelConfig
from pdjax.model import mtp
from pdjax.model import transformer as tfm
from pdjax.model.checks import check_cfg, check_layers, check_tokens, is_tracer


def token_nll_sum(logits_BNV, targets_BN):
    """Sum of -log p(target) over rows and positions (float32)."""
    logp = jax.nn.log_softmax(logits_BNV.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, targets_BN[..., None], axis=-1))


def next_token_loss_sum(logits_BTV, tokens_BT):
    """Sum over rows and positions 0..T-2 of -log p(token[t+1]) (float32)."""
    return token_nll_sum(logits_BTV[:, :-1], tokens_BT[:, 1:])


def mtp_loss_mean(params, cfg: ModelConfig, g_BTD, tokens_BT, moe_impl=None):
    """The mean over depths of each depth's mean cross-entropy; ``g_BTD``: the model's normed
    hidden states (:func:`pdjax.model.transformer.final_hidden`)."""
    B, T = tokens_BT.shape
    per = [next_token_loss_sum(logits, tokens_BT[:, k:]) / (B * (T - 1 - k))
           for k, logits in enumerate(mtp.mtp_logits(params, cfg, g_BTD, tokens_BT, tfm.layer, moe_impl), 1)]
    return sum(per) / len(per)


def loss_core(params, cfg: ModelConfig, tokens_BT, mtp_weight, use_mtp: bool, moe_impl=None):
    """Unjitted :func:`loss` (``use_mtp``: whether the MTP term is computed at all)."""
    B, T = tokens_BT.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, _ = tfm.run_layers(params, cfg, tfm.embed(params, tokens_BT, cfg), q_pos, moe_impl=moe_impl)
    g = tfm.final_hidden(params, cfg, x)
    main = next_token_loss_sum(tfm.logits_of(params, g), tokens_BT) / (B * (T - 1))
    if not use_mtp:
        return main
    return main + mtp_weight * mtp_loss_mean(params, cfg, g, tokens_BT, moe_impl)


_loss = jax.jit(loss_core, static_argnames=("cfg", "use_mtp", "moe_impl"))


def check_mtp_weight(mtp_weight, cfg: ModelConfig):
    """``mtp_weight``: finite and >= 0 (a tracer passes: differentiated or traced over), > 0
    only for a config with MTP modules. Returns it."""
    return mtp_weight if is_tracer(mtp_weight) else model_config_checks.check_mtp_weight(mtp_weight, cfg)


def loss(params, cfg: ModelConfig, tokens, *, mtp_weight=0.0, moe_impl=None):
    """Mean next-token cross-entropy of ``tokens`` [B,T] (float32 scalar), plus ``mtp_weight``
    times the mean MTP cross-entropy (see the module docstring). Differentiable
    (``jax.value_and_grad(pdjax.loss)``); checked before any compute: tokens in the
    vocabulary, T >= 2 (>= depths + 2 with MTP), a config with MTP modules when
    ``mtp_weight`` > 0 (the params hold them: :func:`pdjax.model.checks.check_layers`)."""
    check_cfg(cfg)
    use_mtp = is_tracer(check_mtp_weight(mtp_weight, cfg)) or mtp_weight != 0
    tokens = check_tokens(cfg, tokens, 2)
    check_layers(params, cfg, None, moe_impl)
    need = 2 + (cfg.num_nextn_predict_layers if use_mtp else 0)
    if tokens.shape[1] < need:
        raise ValueError(f"loss needs sequences of at least {need} tokens"
                         f"{' (num_nextn_predict_layers + 2 with mtp_weight)' if use_mtp else ''}, "
                         f"got {tokens.shape[1]}")
    return _loss(params, cfg, tokens, jnp.asarray(mtp_weight, jnp.float32), use_mtp, moe_impl)

