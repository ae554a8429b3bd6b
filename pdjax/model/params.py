"""The model's params: random initialisation (optionally straight into a mesh's placement),
their dtype, and the logical axes of every weight, declared where it is made
(:mod:`pdjax.model.sharding`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pdjax.config import PARAM_DTYPES, ModelConfig, dtype_name
from pdjax.model import mla
from pdjax.model import moe as moe_lib
from pdjax.model import sharding
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare


def param_weights(cfg: ModelConfig, key, dtype) -> dict:
    """The params with their logical axes: a tree of :class:`pdjax.model.sharding.Declared`."""
    D, V = cfg.hidden_size, cfg.vocab_size
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    layers = []
    for i, k in enumerate(jax.random.split(k_layers, cfg.num_hidden_layers)):
        k_attn, k_ffn = jax.random.split(k)
        layer = {"attn_norm": declare(jnp.ones((D,), dtype), ("embed",)),
                 "attn": mla.attention_weights(cfg, k_attn, dtype),
                 "ffn_norm": declare(jnp.ones((D,), dtype), ("embed",))}
        if cfg.is_moe_layer(i):
            layer["moe"] = moe_lib.moe_weights(cfg, k_ffn, dtype)
        else:
            layer["mlp"] = moe_lib.mlp_weights(k_ffn, D, cfg.intermediate_size, dtype)
        layers.append(layer)
    return {
        "embed": declare(jax.random.normal(k_embed, (V, D), jnp.float32).astype(dtype), ("vocab", "embed")),
        "layers": layers,
        "final_norm": declare(jnp.ones((D,), dtype), ("embed",)),
        "lm_head": declare(scaled_normal(k_head, (D, V), D ** -0.5, dtype), ("embed", "vocab")),
    }


def _init(cfg: ModelConfig, key, dtype) -> dict:
    return sharding.values(param_weights(cfg, key, dtype))


@functools.lru_cache(maxsize=64)
def _param_axes(cfg: ModelConfig) -> dict:
    tree = jax.eval_shape(lambda key: param_weights(cfg, key, jnp.dtype(cfg.param_dtype)), jax.random.key(0))
    return sharding.split(tree)[1]


def param_axes(cfg: ModelConfig) -> dict:
    """The logical axes of every param of ``cfg``: a tree like :func:`init_params`' holding a
    tuple per weight (one name of ``pdjax.model.sharding.LOGICAL_AXES`` or None per dim), as
    the init functions declare them (traced only, nothing computed)."""
    return jax.tree.map(lambda axes: axes, _param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))


def logical_axes(params, cfg: ModelConfig, extra=None):
    """The logical axes of every leaf of ``params`` (all of ``cfg``'s params or a part: some
    layers, some weights; arrays or jax.ShapeDtypeStruct) as a tree like it, by
    :func:`param_axes`. ``extra``: ``{"layers/*/moe/name": axes}`` for leaves added above the
    model. Raises ValueError naming a param without a declaration."""
    return sharding.axes_like(params, _param_axes(cfg), extra)


def placement(params, cfg: ModelConfig, mesh, rules=None):
    """The NamedSharding of every param of ``params`` on ``mesh`` by ``rules`` (any
    :class:`pdjax.model.sharding.AxisRules`, e.g. :class:`pdjax.parallel.ShardingRules`;
    default :class:`pdjax.model.sharding.ExpertRules`, the placement of
    ``ShardingRules.default(mesh)``)."""
    rules = sharding.ExpertRules(mesh) if rules is None else rules
    return sharding.shardings(params, logical_axes(params, cfg), mesh, rules)


def init_params(cfg: ModelConfig, key, dtype=None, *, mesh=None, rules=None) -> dict:
    """Random params (normal, std 1/sqrt(fan_in); norms 1; router bias 0, float32).

    ``dtype``: default ``cfg.param_dtype``. ``mesh`` (a jax.sharding.Mesh, with optional
    ``rules``: :class:`pdjax.parallel.ShardingRules` or any
    :class:`pdjax.model.sharding.AxisRules`, mapping the logical axes of :func:`param_axes`):
    the params are made directly in the placement :func:`pdjax.parallel.shard_params` gives
    (one jit with ``out_shardings``: each device computes only its shards) and equal the
    unsharded init bit for bit.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype_name(dtype, "init_params dtype", PARAM_DTYPES))
    if mesh is None:
        return _init(cfg, key, dtype)
    make = functools.partial(_init, cfg, dtype=dtype)
    shardings = placement(jax.eval_shape(make, key), cfg, mesh, rules)
    return jax.jit(make, out_shardings=shardings)(key)


def param_dtype(params) -> jnp.dtype:
    return params["embed"].dtype
