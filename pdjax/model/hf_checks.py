"""A Hugging Face checkpoint held against its config.json before anything is read: the
decoder and multi-token-prediction layers (config.json's ``num_nextn_predict_layers``), the routed experts of each layer, every tensor's
name, shape and stored dtype. Each problem is a ValueError naming the tensor (or the
config.json field), what the checkpoint holds and what the config expects."""

from __future__ import annotations

import math

from pdjax.model_config import PARAM_DTYPES, ModelConfig
from pdjax.model import dsa
from pdjax.model.hf_files import FP8_BLOCK

#: Stored dtypes a weight may have as it is (a param dtype's safetensors name, or float64).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
#: Stored dtypes a 2-D weight may have with a ``weight_scale_inv`` (block-FP8, DeepSeek-V3).
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE = "_scale_inv"


# ---- the tensors a config makes ----------------------------------------------------------

#: MTP-layer tensors a checkpoint may hold besides its own: copies of the model's embedding
#: and head (DeepSeek-V3 stores them; they must equal the model's)
MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def expected_tensors(cfg: ModelConfig, mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` must hold, with HF shapes; ``mtp``: its
    ``num_nextn_predict_layers`` multi-token-prediction layers' too (their
    :data:`MTP_COPIES` are optional)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = (V, D)
    for i in range(cfg.num_hidden_layers):
        _layer_tensors(cfg, i, t)
    for i in mtp_layers(cfg) if mtp else ():
        _layer_tensors(cfg, i, t)
        a = f"model.layers.{i}."
        t.update({a + "enorm.weight": (D,), a + "hnorm.weight": (D,), a + "eh_proj.weight": (D, 2 * D),
                  a + "shared_head.norm.weight": (D,)})
    return t


def mtp_layers(cfg: ModelConfig) -> range:
    """The layer numbers of the MTP depths in a checkpoint (after the decoder's: 61 in V3)."""
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def _layer_tensors(cfg: ModelConfig, i: int, t: dict) -> None:
    """Decoder layer ``i``'s tensors into ``t``."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    K, R, C, Vh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    a = f"model.layers.{i}."
    t[a + "input_layernorm.weight"] = (D,)
    t[a + "post_attention_layernorm.weight"] = (D,)
    s = a + "self_attn."
    if cfg.q_lora_rank is None:
        t[s + "q_proj.weight"] = (H * (K + R), D)
    else:
        Q = cfg.q_lora_rank
        t[s + "q_a_proj.weight"] = (Q, D)
        t[s + "q_a_layernorm.weight"] = (Q,)
        t[s + "q_b_proj.weight"] = (H * (K + R), Q)
    t[s + "kv_a_proj_with_mqa.weight"] = (C + R, D)
    t[s + "kv_a_layernorm.weight"] = (C,)
    t[s + "kv_b_proj.weight"] = (H * (K + Vh), C)
    t[s + "o_proj.weight"] = (D, H * Vh)
    if cfg.sparse_attention:
        t.update(dsa.indexer_tensors(cfg, s + "indexer."))
    m = a + "mlp."
    if cfg.is_moe_layer(i):
        F, E = cfg.moe_intermediate_size, cfg.n_routed_experts
        t[m + "gate.weight"] = (E, D)
        if cfg.topk_method == "noaux_tc":
            t[m + "gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            _mlp_names(t, f"{m}experts.{e}.", D, F)
        if cfg.n_shared_experts:
            _mlp_names(t, m + "shared_experts.", D, F * cfg.n_shared_experts)
    else:
        _mlp_names(t, m, D, cfg.intermediate_size)


def _mlp_names(t, prefix, D, F):
    t[prefix + "gate_proj.weight"] = (F, D)
    t[prefix + "up_proj.weight"] = (F, D)
    t[prefix + "down_proj.weight"] = (D, F)


# ---- the checks --------------------------------------------------------------------------

def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def _check_layers(cfg: ModelConfig, path: str, names, mtp: bool) -> list[int]:
    """The layers past num_hidden_layers, which must be multi-token-prediction layers that
    config.json declares (num_nextn_predict_layers), each with its ``eh_proj``; with
    ``mtp``, every one it declares."""
    L, nextn = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    layers = {i for i in map(_layer, names) if i is not None}
    held = max(layers) + 1 if layers else 0
    if held < L:
        raise ValueError(f"checkpoint {path} holds {held} layers (model.layers.0..{held - 1}), "
                         f"config.json num_hidden_layers={L}")
    if held > L + nextn:
        raise ValueError(f"checkpoint {path} holds {held} layers (model.layers.0..{held - 1}), config.json at "
                         f"most {L + nextn} (num_hidden_layers={L} + num_nextn_predict_layers={nextn})")
    extra = sorted(i for i in layers if i >= L)
    if mtp and held < L + nextn:
        raise ValueError(f"config.json at {path} declares num_nextn_predict_layers={nextn}, the checkpoint holds "
                         f"{held - L} such layers (model.layers.{L}..{L + nextn - 1}); load_hf(path, mtp=False) "
                         "loads the model without them")
    for i in extra:
        if f"model.layers.{i}.eh_proj.weight" not in names:
            raise ValueError(f"layer {i} of checkpoint {path} (past config.json num_hidden_layers={L}) "
                             "holds no eh_proj.weight: a decoder layer, not a multi-token-prediction one")
    return extra


def _check_experts(cfg: ModelConfig, path: str, names, mtp: bool) -> None:
    """Each decoder layer holds the routed experts config.json gives it: n_routed_experts
    in a MoE layer, none in a dense one."""
    held: dict[int, set] = {}
    for name in names:
        i, parts = _layer(name), name.split(".")
        if i is not None and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            held.setdefault(i, set()).add(int(parts[5]))
    for i in [*range(cfg.num_hidden_layers), *(mtp_layers(cfg) if mtp else ())]:
        n = max(held[i]) + 1 if i in held else 0
        if cfg.is_moe_layer(i) and n != cfg.n_routed_experts:
            raise ValueError(f"layer {i} of checkpoint {path} holds {n} routed experts, config.json "
                             f"n_routed_experts={cfg.n_routed_experts}")
        if not cfg.is_moe_layer(i) and n:
            raise ValueError(f"layer {i} of checkpoint {path} holds {n} routed experts, but config.json makes "
                             f"it dense (n_routed_experts={cfg.n_routed_experts}, first_k_dense_replace="
                             f"{cfg.first_k_dense_replace}, moe_layer_freq={cfg.moe_layer_freq})")


def _check_dtype(name: str, stored: dict, path: str) -> None:
    """A weight is floating; block-FP8 only in 2-D with a floating ``_scale_inv`` of one
    entry per 128x128 block; never an integer or bool, nothing cast silently."""
    dtype, shape = stored[name]["dtype"], tuple(stored[name]["shape"])
    scale = stored.get(name + SCALE)
    if dtype in FLOAT_DTYPES and scale is None:
        return
    if dtype in FP8_DTYPES and len(shape) == 2 and scale is not None:
        blocks = tuple(math.ceil(d / FP8_BLOCK) for d in shape)
        if scale["dtype"] not in FLOAT_DTYPES or tuple(scale["shape"]) != blocks:
            raise ValueError(f"tensor {name + SCALE} in checkpoint {path} is {scale['dtype']} of shape "
                             f"{tuple(scale['shape'])}, expected a float of shape {blocks} "
                             f"(one per {FP8_BLOCK}x{FP8_BLOCK} block of {name} {shape})")
        return
    if scale is not None:
        raise ValueError(f"tensor {name} in checkpoint {path} is {dtype} with a {name + SCALE}; "
                         f"block scales go with a 2-D weight of {FP8_DTYPES}")
    raise ValueError(f"tensor {name} in checkpoint {path} is stored as {dtype}, expected a float "
                     f"{FLOAT_DTYPES} (or {FP8_DTYPES} with a {name + SCALE})")


def check_checkpoint(cfg: ModelConfig, path: str, readers: dict, where: dict, mtp: bool = True) -> list[str]:
    """Hold the checkpoint's tensors (``where``: name -> file, ``readers``: file ->
    SafetensorsFile) against ``cfg``: layer count, routed experts, names, shapes, dtypes.
    Raise ValueError naming the first problem. Returns the tensors the load leaves out: the
    multi-token-prediction layers' when not ``mtp``, else their copies of the embedding and
    head (:data:`MTP_COPIES`, checked for shape here and for equality by the loader)."""
    stored = {name: readers[file].header[name] for name, file in where.items()}
    extra_layers = _check_layers(cfg, path, stored, mtp)
    _check_experts(cfg, path, stored, mtp)
    expected = expected_tensors(cfg, mtp)
    copies = {f"model.layers.{i}.{c}" for i in mtp_layers(cfg) for c in MTP_COPIES} if mtp else set()
    left, unexpected = [], []
    for name in stored:
        base = name[:-len(SCALE)] if name.endswith(SCALE) else name
        if base in expected or name.endswith("rotary_emb.inv_freq"):
            continue
        (left if base in copies or (not mtp and _layer(base) in extra_layers) else unexpected).append(name)
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]} in checkpoint {path} "
                         f"({len(unexpected)} unexpected in all)")
    missing = [n for n in expected if n not in stored]
    if missing:
        raise ValueError(f"missing tensor {missing[0]} in checkpoint {path} ({len(missing)} missing in all)")
    V, D = cfg.vocab_size, cfg.hidden_size
    for name, shape in [*expected.items(), *((n, (V, D)) for n in left if n in copies)]:
        if tuple(stored[name]["shape"]) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(stored[name]['shape'])}, expected {shape} "
                             f"from config.json (checkpoint {path})")
        _check_dtype(name, stored, path)
    return left


def stored_dtype(path: str, readers: dict, where: dict):
    """The dtype of the checkpoint's embedding, which must be a param dtype."""
    stored = readers[where["model.embed_tokens.weight"]].header["model.embed_tokens.weight"]["np_dtype"]
    if stored.name not in PARAM_DTYPES:
        raise ValueError(f"checkpoint {path} stores its embedding as {stored.name}; pass load_hf(..., "
                         f"dtype=) one of {PARAM_DTYPES}")
    return stored
