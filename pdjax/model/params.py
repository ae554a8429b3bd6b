"""The model's params: random initialisation (optionally straight into a mesh's placement),
their shapes and dtype, the logical axes of every weight, declared where it is made
(:mod:`pdjax.model.sharding`), and their shardings on a mesh (re-exported by
:mod:`pdjax.parallel`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pdjax.model_config import PARAM_DTYPES, ModelConfig, dtype_name
from pdjax.model import mla, mtp
from pdjax.model import moe as moe_lib
from pdjax.model import sharding
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare


def layer_weights(cfg: ModelConfig, index: int, key, dtype) -> dict:
    """Decoder layer ``index``'s weights with their logical axes (MoE or dense MLP by
    ``cfg.is_moe_layer(index)``; the MTP blocks' indices follow the model's layers)."""
    D = cfg.hidden_size
    k_attn, k_ffn = jax.random.split(key)
    layer = {"attn_norm": declare(jnp.ones((D,), dtype), ("embed",)),
             "attn": mla.attention_weights(cfg, k_attn, dtype),
             "ffn_norm": declare(jnp.ones((D,), dtype), ("embed",))}
    if cfg.is_moe_layer(index):
        layer["moe"] = moe_lib.moe_weights(cfg, k_ffn, dtype)
    else:
        layer["mlp"] = moe_lib.mlp_weights(k_ffn, D, cfg.intermediate_size, dtype)
    return layer


def param_weights(cfg: ModelConfig, key, dtype) -> dict:
    """The params with their logical axes: a tree of :class:`pdjax.model.sharding.Declared`
    (``"mtp"``: the MTP modules, only when ``cfg.num_nextn_predict_layers`` > 0)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    out = {
        "embed": declare(jax.random.normal(k_embed, (V, D), jnp.float32).astype(dtype), ("vocab", "embed")),
        "layers": [layer_weights(cfg, i, k, dtype)
                   for i, k in enumerate(jax.random.split(k_layers, cfg.num_hidden_layers))],
        "final_norm": declare(jnp.ones((D,), dtype), ("embed",)),
        "lm_head": declare(scaled_normal(k_head, (D, V), D ** -0.5, dtype), ("embed", "vocab")),
    }
    if cfg.num_nextn_predict_layers:
        out[mtp.MTP] = mtp.mtp_weights(cfg, key, dtype, layer_weights)
    return out


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


#: logical axes of what :func:`pdjax.parallel.place_experts` adds to a MoE layer's params:
#: EPLB's replica tables, whole
PLACEMENT_AXES = {"layers/*/moe/log2phy": (None, None), "layers/*/moe/logcnt": (None,)}


def param_logical_axes(params, cfg: ModelConfig) -> dict:
    """A pytree like ``params`` (all of ``cfg``'s params or a part: some layers, some weights;
    arrays or jax.ShapeDtypeStruct) holding each leaf's logical axes (a tuple of names/None),
    as the model declares them (:func:`param_axes`; EPLB's replica tables
    :data:`PLACEMENT_AXES`). Raises ValueError naming a param the model does not declare."""
    return sharding.axes_like(params, _param_axes(cfg), PLACEMENT_AXES)


def param_shardings(params, cfg: ModelConfig, mesh, rules: sharding.ShardingRules | None = None):
    """The NamedSharding of every param by the rules applied to the model's logical axes
    (default ``ShardingRules.default(mesh)``: routed experts over the expert axis, everything
    else replicated), as a pytree like ``params`` (all of the params or a part). ``params``
    may hold arrays or jax.ShapeDtypeStruct (only paths and shapes are read), so an init or a
    checkpoint load can be placed before any value exists. Raises ValueError naming the param
    when one has no logical-axis declaration or a sharded dim (e.g. the experts) does not
    divide over its mesh axes."""
    rules = sharding.ShardingRules.default(mesh) if rules is None else rules
    return sharding.shardings(params, param_logical_axes(params, cfg), mesh, rules)


def param_shapes(cfg: ModelConfig) -> dict:
    """The shapes and dtypes of ``init_params(cfg, key)``: a tree like it of jax.ShapeDtypeStruct
    (traced abstractly, key included: nothing is computed or allocated, no program runs)."""
    return jax.eval_shape(lambda key: init_params(cfg, key), jax.eval_shape(jax.random.key, 0))


def init_params(cfg: ModelConfig, key, dtype=None, *, mesh=None, rules=None) -> dict:
    """Random params (normal, std 1/sqrt(fan_in); norms 1; router bias 0, float32).

    ``dtype``: default ``cfg.param_dtype``. ``mesh`` (a jax.sharding.Mesh, with optional
    ``rules``: :class:`pdjax.model.sharding.ShardingRules`, mapping the logical axes of
    :func:`param_axes`): the params are made directly in the placement
    :func:`param_shardings` gives (one jit with ``out_shardings``: each device computes only
    its shards) and equal the unsharded init bit for bit.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype_name(dtype, "init_params dtype", PARAM_DTYPES))
    if mesh is None:
        return _init(cfg, key, dtype)
    make = functools.partial(_init, cfg, dtype=dtype)
    shardings = param_shardings(jax.eval_shape(make, key), cfg, mesh, rules)
    return jax.jit(make, out_shardings=shardings)(key)


def param_dtype(params) -> jnp.dtype:
    return params["embed"].dtype
