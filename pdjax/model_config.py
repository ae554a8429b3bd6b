"""Model configuration: a frozen, hashable dataclass whose fields follow the Hugging Face
DeepSeek-V2/V3 ``config.json`` keys, plus presets and validation.

The config is static data: it is passed as a static argument to jitted functions, so it
must be hashable (``rope_scaling`` is stored as a frozen :class:`RopeScaling`, never a dict).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

from pdjax.arguments import ArgumentTypeError, check_int

from pdjax.model_config_checks import SCORING_FUNCS, TOPK_METHODS, check_finite, check_types, real, validate  # noqa: F401 - public names

# Precision: the dtypes params, activations and the latent cache may take (canonical names,
# as numpy/ml_dtypes spell them), and the short names accepted for them.
PARAM_DTYPES = ("float32", "bfloat16", "float16")
COMPUTE_DTYPES = PARAM_DTYPES
CACHE_DTYPES = PARAM_DTYPES + ("float8_e4m3fn", "float8_e5m2")
DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16",
                 "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn",
                 "float8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def dtype_name(value, what: str, allowed=CACHE_DTYPES) -> str:
    """The canonical name of a dtype given as a string ("bf16", "bfloat16"), a numpy dtype or
    a jax/numpy scalar type (``jnp.bfloat16``). Raises ValueError naming ``what`` (the field
    or argument) when it is not one of ``allowed``."""
    name = value
    if not isinstance(value, str):
        try:
            import numpy as np
            name = np.dtype(value).name
        except TypeError:
            name = None
    name = DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in allowed:
        raise ValueError(f"{what} must be one of {allowed} (or {sorted(DTYPE_ALIASES)}), got {value!r}")
    return name


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (the only kind DeepSeek uses). Field names follow HF."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    rope_type: str = "yarn"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.type == "float":
                object.__setattr__(self, f.name, real(f"rope_scaling.{f.name}", getattr(self, f.name)))
        check_finite(self, "rope_scaling")
        object.__setattr__(self, "original_max_position_embeddings",
                           check_int("rope_scaling.original_max_position_embeddings",
                                     self.original_max_position_embeddings))
        if not isinstance(self.rope_type, str):
            raise ArgumentTypeError(f"rope_scaling.rope_type must be a string, got {self.rope_type!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V2/V3 architecture hyper-parameters (HF names).

    Dimensions: ``hidden_size`` D, ``num_attention_heads`` H, ``kv_lora_rank`` C (MLA latent),
    ``qk_rope_head_dim`` R (decoupled RoPE key shared by all heads), ``qk_nope_head_dim``,
    ``v_head_dim``; ``q_lora_rank`` None means a plain q projection (V2-Lite);
    ``num_nextn_predict_layers``: DeepSeek-V3's multi-token-prediction depths
    (:mod:`pdjax.model.mtp`; 0: none). ``index_n_heads``, ``index_head_dim``, ``index_topk``:
    DeepSeek-V3.2's sparse attention (:mod:`pdjax.model.dsa`; 0: none): a lightning indexer
    of that many heads and key width picks the ``index_topk`` cached tokens each query
    attends to.

    Precision (pdjax fields, not HF ones; written to and read from ``config.json`` by
    :meth:`to_hf_dict` / :func:`from_hf_dict`). Each is a dtype name; short names ("bf16",
    "fp8") and numpy/jax dtypes are accepted and normalised:

    * ``param_dtype``: what :func:`pdjax.init_params` makes params in (float32, bfloat16,
      float16). :func:`pdjax.load_hf` sets it to the dtype it loaded.
    * ``compute_dtype``: the activations (the residual stream) and the matmul inputs; weights
      are cast to it where they are used, so bf16 params with float32 compute is the usual
      "bf16 weights, f32 math" setting. Softmax, RMSNorm, RoPE, the router scores, the
      expert combine and the logits run in float32 whatever it is.
    * ``cache_dtype``: the latent KV cache (also float8_e4m3fn / float8_e5m2, stored without
      a scale, saturating at the format's largest finite value); None follows
      ``compute_dtype``. Read with :attr:`kv_cache_dtype`.

    The defaults (float32 everywhere) are pdjax's reference numerics.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: Optional[int] = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    model_type: str = "deepseek_v3"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    cache_dtype: Optional[str] = None

    def __post_init__(self):
        check_types(self)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _rope_scaling_from_dict(dict(self.rope_scaling)))
        for field, allowed in (("param_dtype", PARAM_DTYPES), ("compute_dtype", COMPUTE_DTYPES),
                               ("cache_dtype", CACHE_DTYPES)):
            value = getattr(self, field)
            if value is not None or field != "cache_dtype":
                object.__setattr__(self, field, dtype_name(value, f"ModelConfig.{field}", allowed))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"ModelConfig.rope_scaling must be RopeScaling, dict or None, "
                            f"got {type(self.rope_scaling).__name__}")
        validate(self)

    # ---- precision -----------------------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> str:
        """The latent cache's dtype: ``cache_dtype``, or ``compute_dtype`` when that is None."""
        return self.compute_dtype if self.cache_dtype is None else self.cache_dtype

    # ---- derived sizes -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim (the MLA row
        :attr:`mla_latent_dim`), and the indexer's key (``index_head_dim``) with sparse
        attention."""
        return self.mla_latent_dim + self.index_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """What MLA reads of a cached row: [RMSNorm(latent) | RoPE(k_pe)], kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek-V3.2's sparse attention (DSA) is on: ``index_topk`` > 0."""
        return self.index_topk > 0

    @property
    def routed_scaling_always(self) -> bool:
        """V3 scales routed weights always; V2 only when top-k weights are not normalised."""
        return self.model_type != "deepseek_v2"

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(mscale_all_dim)^2 when scaling is on."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    def _repr_html_(self) -> str:
        """A notebook table: the architecture's key sizes and the parameter counts (total,
        active per token, per component; from :func:`pdjax.analysis.param_counts`)."""
        import html

        from pdjax.param_counts import param_counts

        keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok",
                "n_shared_experts", "first_k_dense_replace", "vocab_size")
        rows = "".join(f"<tr><td>{k}</td><td>{html.escape(str(getattr(self, k)))}</td></tr>" for k in keys)
        return (f"<div style='display:flex;gap:2em'><table><tr><th>config</th><th></th></tr>{rows}</table>"
                f"{param_counts(self)._repr_html_()}</div>")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_dict()
        if self.rope_scaling is not None:
            d["rope_scaling"]["type"] = "yarn"
        return d


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention magnitude correction 0.1*mscale*ln(scale)+1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


_ROPE_FIELDS = {f.name for f in dataclasses.fields(RopeScaling)}


def _rope_scaling_from_dict(d: dict) -> RopeScaling:
    """A RopeScaling from a config's dict: every key known (a typo such as "factr" is an
    error, not a default), every value present (``factor: null`` is an error, not 1.0) and
    typed (RopeScaling checks them). ``truncate`` (transformers' YaRN knob) may only say what
    DeepSeek does: true."""
    d = dict(d)
    kind = d.pop("rope_type", None) or d.pop("type", None) or "yarn"
    d.pop("type", None)
    d.pop("rope_theta", None)
    if d.pop("truncate", True) is not True:
        raise ValueError("ModelConfig.rope_scaling.truncate must be true (DeepSeek's YaRN truncates), got "
                         "another value")
    unknown = sorted(set(d) - _ROPE_FIELDS)
    if unknown:
        raise ValueError(f"ModelConfig.rope_scaling has unknown key(s) {unknown}; known: {sorted(_ROPE_FIELDS)}")
    missing = sorted(k for k, v in d.items() if v is None)
    if missing:
        raise ValueError(f"ModelConfig.rope_scaling.{missing[0]} must be a number, got None")
    return RopeScaling(rope_type=kind, **d)


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _hf_scaling(value, key: str) -> Optional[RopeScaling]:
    """The RopeScaling a config.json's ``rope_scaling`` or ``rope_parameters`` (``key``)
    gives: None for null or a "default" rope type."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"config.json {key} must be an object or null, got {value!r}")
    if value.get("rope_type", value.get("type")) in (None, "default"):
        return None
    return _rope_scaling_from_dict(dict(value))


def _rope_summary(rs: Optional[RopeScaling]) -> dict:
    return {"rope_type": "default"} if rs is None else rs.to_dict()


def _hf_rope(d: dict) -> tuple[Optional[RopeScaling], Any]:
    """(rope scaling, rope_theta) of a config.json: ``rope_scaling`` + ``rope_theta``, or the
    newer ``rope_parameters`` (which holds its own ``rope_theta``). A file holding both forms
    must hold the same values in each: a contradiction is a ValueError naming both keys."""
    scaling, theta = _hf_scaling(d.get("rope_scaling"), "rope_scaling"), d.get("rope_theta")
    params = d.get("rope_parameters")
    if params is None:
        return scaling, theta
    new = _hf_scaling(params, "rope_parameters")
    new_theta = params.get("rope_theta", theta)
    if d.get("rope_scaling") is not None and new != scaling:
        old_d, new_d = _rope_summary(scaling), _rope_summary(new)
        keys = ["rope_type"] if old_d["rope_type"] != new_d["rope_type"] else [k for k in old_d if old_d[k] != new_d[k]]
        diff = "; ".join(f"{k}: {old_d.get(k)!r} vs {new_d.get(k)!r}" for k in keys)
        raise ValueError(f"config.json holds rope_scaling and rope_parameters that disagree (rope_scaling vs "
                         f"rope_parameters: {diff}); keep one of them, or make them agree")
    if theta is not None and new_theta != theta and not (new_theta != new_theta and theta != theta):
        raise ValueError(f"config.json holds rope_theta={theta!r} and rope_parameters.rope_theta={new_theta!r}, "
                         "which disagree; keep one of them, or make them agree")
    return new, new_theta


def from_hf_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a HF config.json dict (``rope_scaling`` + ``rope_theta``,
    or the newer ``rope_parameters``; both forms may be given only if they agree). Unknown
    keys are ignored; bad values raise ValueError."""
    if not isinstance(d, Mapping):
        raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
    d = dict(d)
    model_type = d.get("model_type", "deepseek_v3")
    if model_type not in ("deepseek_v2", "deepseek_v3", "deepseek_v32"):
        raise ValueError(f"config.json model_type must be deepseek_v2, deepseek_v3 or deepseek_v32, got {model_type!r}")
    rope_scaling, rope_theta = _hf_rope(d)
    kwargs = {k: v for k, v in d.items() if k in _FIELDS}
    kwargs["model_type"] = model_type
    kwargs["rope_scaling"] = rope_scaling
    if rope_theta is not None:
        kwargs["rope_theta"] = rope_theta
    if kwargs.get("n_routed_experts") is None:
        kwargs["n_routed_experts"] = 0
    if kwargs.get("n_shared_experts") is None:
        kwargs["n_shared_experts"] = 0
    for k in ("n_group", "topk_group"):
        if kwargs.get(k) is None:
            kwargs[k] = 1
    if kwargs.get("routed_scaling_factor") is None:
        kwargs["routed_scaling_factor"] = 1.0
    # transformers' DeepseekV3 config has no scoring_func/topk_method: V3 is always
    # sigmoid + noaux_tc; DeepSeek-V2's remote code defaults to softmax + greedy.
    v3 = model_type != "deepseek_v2"
    if kwargs.get("topk_method") is None:
        kwargs["topk_method"] = "noaux_tc" if v3 else "greedy"
    if kwargs.get("scoring_func") is None:
        kwargs["scoring_func"] = "sigmoid" if v3 else "softmax"
    try:
        return ModelConfig(**kwargs)
    except TypeError as e:  # wrong value types surface as ValueError naming the problem
        raise ValueError(f"config.json: {e}") from e


def load_hf_config(path: str) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {file}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed config.json at {file}: {e}") from None
    return from_hf_dict(d)
