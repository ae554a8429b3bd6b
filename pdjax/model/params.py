"""The model's params: random initialisation (optionally straight into a mesh's placement)
and their dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pdjax.config import PARAM_DTYPES, ModelConfig, dtype_name
from pdjax.model import mla
from pdjax.model import moe as moe_lib
from pdjax.model.initializers import scaled_normal


def _init(cfg: ModelConfig, key, dtype) -> dict:
    D, V = cfg.hidden_size, cfg.vocab_size
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    layers = []
    for i, k in enumerate(jax.random.split(k_layers, cfg.num_hidden_layers)):
        k_attn, k_ffn = jax.random.split(k)
        layer = {"attn_norm": jnp.ones((D,), dtype), "attn": mla.init_attention(cfg, k_attn, dtype),
                 "ffn_norm": jnp.ones((D,), dtype)}
        if cfg.is_moe_layer(i):
            layer["moe"] = moe_lib.init_moe(cfg, k_ffn, dtype)
        else:
            layer["mlp"] = moe_lib.init_mlp(k_ffn, D, cfg.intermediate_size, dtype)
        layers.append(layer)
    return {
        "embed": jax.random.normal(k_embed, (V, D), jnp.float32).astype(dtype),
        "layers": layers,
        "final_norm": jnp.ones((D,), dtype),
        "lm_head": scaled_normal(k_head, (D, V), D ** -0.5, dtype),
    }


def init_params(cfg: ModelConfig, key, dtype=None, *, mesh=None, rules=None) -> dict:
    """Random params (normal, std 1/sqrt(fan_in); norms 1; router bias 0, float32).

    ``dtype``: default ``cfg.param_dtype``. ``mesh`` (a jax.sharding.Mesh, with optional
    :class:`pdjax.parallel.ShardingRules`): the params are made directly in the placement
    :func:`pdjax.parallel.shard_params` gives (one jit with ``out_shardings``: each device
    computes only its shards) and equal the unsharded init bit for bit.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype_name(dtype, "init_params dtype", PARAM_DTYPES))
    if mesh is None:
        return _init(cfg, key, dtype)
    from pdjax.parallel.mesh import param_shardings

    make = functools.partial(_init, cfg, dtype=dtype)
    shardings = param_shardings(jax.eval_shape(make, key), cfg, mesh, rules)
    return jax.jit(make, out_shardings=shardings)(key)


def param_dtype(params) -> jnp.dtype:
    return params["embed"].dtype
