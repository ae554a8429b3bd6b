"""The checks of :class:`pdjax.model_config.ModelConfig`, made on construction: every field of its
type (:func:`check_types`), then ranges and relations between fields (:func:`validate`).
Each raises naming the field.

Finiteness is checked in one place, :func:`check_finite`: a walk over every float reachable
from the config (its fields, a nested dataclass such as ``rope_scaling``, a dict's or a
list's values), so a float field added later is covered without being listed anywhere."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterator, Mapping

from pdjax.arguments import ArgumentTypeError, check_int, check_nonnegative

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")

INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
              "first_k_dense_replace", "moe_layer_freq", "max_position_embeddings", "num_nextn_predict_layers",
              "index_n_heads", "index_head_dim", "index_topk")
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")
FLOAT_FIELDS = ("routed_scaling_factor", "rope_theta", "rms_norm_eps")
BOOL_FIELDS = ("norm_topk_prob", "tie_word_embeddings")
STR_FIELDS = ("scoring_func", "topk_method", "model_type")


def float_fields(obj, where: str) -> Iterator[tuple[str, float]]:
    """``(path, value)`` of every float reachable from ``obj``: a dataclass's fields, a
    mapping's values, a list's or tuple's items, recursively (``"ModelConfig.rope_scaling.
    mscale"``); integers and bools are not floats."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from float_fields(getattr(obj, f.name), f"{where}.{f.name}")
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from float_fields(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from float_fields(v, f"{where}[{i}]")
    elif isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        yield where, obj


def check_finite(obj, where: str) -> None:
    """The one finiteness check of a config: every float :func:`float_fields` reaches is
    finite; a NaN or an infinity is a ValueError naming its path and value."""
    for path, value in float_fields(obj, where):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be finite, got {value!r}")


def real(name: str, value) -> float:
    """``value`` as a float if it is a real number (numpy scalars too; not a bool, not a
    string): its type only, finiteness is :func:`check_finite`'s. A Python int too large
    for a float becomes inf (refused there)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_types(cfg) -> None:
    """Every field of its type, never coerced: integers (numpy integers too, stored as int;
    not floats such as 8.0, not bools), reals (stored as float; not strings, not bools),
    bools (not the string "false"), strings. ArgumentTypeError (a TypeError and a
    ValueError) naming the field; finiteness, ranges and relations are :func:`validate`'s."""
    import numpy as np

    def put(name, value):
        object.__setattr__(cfg, name, value)

    for name in INT_FIELDS:
        put(name, check_int(f"ModelConfig.{name}", getattr(cfg, name), minimum=None))
    if cfg.q_lora_rank is not None:
        put("q_lora_rank", check_int("ModelConfig.q_lora_rank", cfg.q_lora_rank, minimum=None))
    for name in FLOAT_FIELDS:
        put(name, real(f"ModelConfig.{name}", getattr(cfg, name)))
    for name in BOOL_FIELDS:
        value = getattr(cfg, name)
        if not isinstance(value, (bool, np.bool_)):
            raise ArgumentTypeError(f"ModelConfig.{name} must be a bool (true/false), got {value!r}")
        put(name, bool(value))
    for name in STR_FIELDS:
        if not isinstance(getattr(cfg, name), str):
            raise ArgumentTypeError(f"ModelConfig.{name} must be a string, got {getattr(cfg, name)!r}")


def _positive(cfg, names):
    for name in names:
        v = getattr(cfg, name)
        if not isinstance(v, (int,)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"ModelConfig.{name} must be a positive integer, got {v!r}")


def validate(cfg) -> None:
    """Raise ValueError naming the first inconsistent field: first any float that is not
    finite (:func:`check_finite`, over every field and nested part), then ranges and
    relations."""
    check_finite(cfg, "ModelConfig")
    _positive(cfg, ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "max_position_embeddings", "moe_layer_freq"])
    if cfg.q_lora_rank is not None:
        _positive(cfg, ["q_lora_rank"])
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"ModelConfig.qk_rope_head_dim must be even for RoPE pairs, got {cfg.qk_rope_head_dim}")
    if cfg.first_k_dense_replace < 0:
        raise ValueError(f"ModelConfig.first_k_dense_replace must be >= 0, got {cfg.first_k_dense_replace}")
    if cfg.num_nextn_predict_layers < 0:
        raise ValueError(f"ModelConfig.num_nextn_predict_layers must be >= 0, got {cfg.num_nextn_predict_layers}")
    layers = range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)       # the MTP blocks too
    has_dense = any(not cfg.is_moe_layer(i) for i in layers) if cfg.n_routed_experts else True
    if has_dense:
        _positive(cfg, ["intermediate_size"])
    if cfg.n_routed_experts < 0:
        raise ValueError(f"ModelConfig.n_routed_experts must be >= 0, got {cfg.n_routed_experts}")
    if cfg.n_routed_experts:
        _validate_moe(cfg)
    _validate_kinds(cfg)
    _validate_dsa(cfg)


def _validate_dsa(cfg) -> None:
    """DeepSeek-V3.2's sparse attention: its three fields all 0 (none) or all positive, with
    a q LoRA (the indexer's query reads its residual) and a key wide enough for the rope part."""
    names = ("index_n_heads", "index_head_dim", "index_topk")
    values = [getattr(cfg, n) for n in names]
    if any(v < 0 for v in values) or (any(values) and not all(values)):
        raise ValueError("ModelConfig.index_n_heads, index_head_dim and index_topk (DeepSeek sparse attention) "
                         f"must be all 0 or all positive, got {dict(zip(names, values))}")
    if any(values):
        if cfg.q_lora_rank is None:
            raise ValueError("ModelConfig.index_topk > 0 (DeepSeek sparse attention) needs q_lora_rank: the "
                             "indexer's query is projected from the query's LoRA residual")
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ValueError(f"ModelConfig.index_head_dim={cfg.index_head_dim} must be >= qk_rope_head_dim="
                             f"{cfg.qk_rope_head_dim} (its first qk_rope_head_dim dims are rotated)")


def _validate_moe(cfg) -> None:
    """The routed experts' fields (a MoE config)."""
    _positive(cfg, ["moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group"])
    if cfg.n_shared_experts < 0:
        raise ValueError(f"ModelConfig.n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError(
            f"ModelConfig.num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
            f"n_routed_experts={cfg.n_routed_experts}")
    if cfg.n_routed_experts % cfg.n_group:
        raise ValueError(
            f"ModelConfig.n_routed_experts={cfg.n_routed_experts} is not divisible by "
            f"n_group={cfg.n_group}")
    if cfg.topk_group > cfg.n_group:
        raise ValueError(f"ModelConfig.topk_group={cfg.topk_group} exceeds n_group={cfg.n_group}")
    per_group = cfg.n_routed_experts // cfg.n_group
    if cfg.topk_method == "noaux_tc" and per_group < 2 and cfg.n_group > 1:
        raise ValueError("ModelConfig.n_group: noaux_tc scores groups by their top-2 experts, "
                         f"so each group needs >= 2 experts (got {per_group})")
    if cfg.topk_group * per_group < cfg.num_experts_per_tok:
        raise ValueError(
            f"ModelConfig.topk_group={cfg.topk_group} groups of {per_group} experts cannot "
            f"supply num_experts_per_tok={cfg.num_experts_per_tok}")


def _validate_kinds(cfg) -> None:
    """The named choices, the positive reals and YaRN's fields."""
    if cfg.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"ModelConfig.scoring_func must be one of {SCORING_FUNCS}, got {cfg.scoring_func!r}")
    if cfg.topk_method not in TOPK_METHODS:
        raise ValueError(f"ModelConfig.topk_method must be one of {TOPK_METHODS}, got {cfg.topk_method!r}")
    if cfg.rms_norm_eps <= 0:
        raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {cfg.rms_norm_eps}")
    if cfg.routed_scaling_factor <= 0:
        raise ValueError(f"ModelConfig.routed_scaling_factor must be > 0, got {cfg.routed_scaling_factor}")
    if cfg.rope_theta <= 0:
        raise ValueError(f"ModelConfig.rope_theta must be > 0, got {cfg.rope_theta}")
    if cfg.model_type not in MODEL_TYPES:
        raise ValueError(f"ModelConfig.model_type must be one of {MODEL_TYPES}, got {cfg.model_type!r}")
    rs = cfg.rope_scaling
    if rs is not None:
        if rs.rope_type != "yarn":
            raise ValueError(f"ModelConfig.rope_scaling type must be 'yarn', got {rs.rope_type!r}")
        if rs.factor <= 0:
            raise ValueError(f"ModelConfig.rope_scaling.factor must be > 0, got {rs.factor}")
        if rs.original_max_position_embeddings <= 0:
            raise ValueError("ModelConfig.rope_scaling.original_max_position_embeddings must be > 0, "
                             f"got {rs.original_max_position_embeddings}")


def check_mtp_weight(mtp_weight, cfg) -> float:
    """``mtp_weight`` (the MTP loss's weight, DeepSeek-V3's lambda): a finite real >= 0, and
    > 0 only for a config with MTP modules (``cfg.num_nextn_predict_layers`` > 0). Returns it.
    The pure check (the cost model of :mod:`pdjax.analysis.pipeline_costs`, and
    :func:`pdjax.model.loss.check_mtp_weight` for a weight that is not traced)."""
    if check_nonnegative("mtp_weight", mtp_weight) and not cfg.num_nextn_predict_layers:
        raise ValueError(f"mtp_weight={mtp_weight!r} needs the MTP modules: cfg.num_nextn_predict_layers is 0")
    return mtp_weight
