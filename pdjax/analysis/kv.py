"""KV-cache accounting: bytes per token for each attention kind, and the concurrency bound.

Per token, summed over the L layers (DeepSeek-V2 report, Table 1):

==========  ==========================  ===================================
attention   elements per token          DeepSeek-V3 (L=61, bf16)
==========  ==========================  ===================================
MHA         2 * n_h * d_h * L           3,997,696 B (3.81 MiB)
GQA         2 * n_g * d_h * L           n_g KV heads
MQA         2 * d_h * L                 one KV head
MLA         (d_c + d_R) * L             70,272 B (68.6 KiB)
==========  ==========================  ===================================

For the MHA/GQA/MQA counterfactuals of an MLA config, a key head has ``qk_nope_head_dim``
elements and a value head ``v_head_dim`` (both d_h = 128 in DeepSeek), so
"2 * d_h" is ``qk_nope_head_dim + v_head_dim``: the decoupled RoPE part is MLA's own and
is not carried over. MLA caches ``kv_lora_rank + qk_rope_head_dim`` (= d_c + d_R) values; with DeepSeek-V3.2's
sparse attention (DSA) a cached row also holds the lightning indexer's key (``index_head_dim``
values), ``cfg.kv_latent_dim`` in all.

Two layouts of an MLA row (:data:`KV_LAYOUTS`; per token per layer):

* ``"uniform"``: every cached value in the cache dtype (``dtype_bytes`` each), the indexer key
  beside the latent: transformers' ``DeepseekV32`` cache and pdjax's. V3.2 in bf16:
  704 x 2 = 1,408 B, 85,888 B over 61 layers (V3: 576 x 2 = 1,152 B, 70,272 B).
* ``"deepseek-fp8"``: what DeepSeek's released kernels store (:func:`kv_row_bytes`): the
  latent in FP8 with one float32 scale per 128 values and the RoPE part in BF16
  (FlashMLA's "FP8 with scale" format, 656 B for C = 512, R = 64), and with DSA the
  indexer key in FP8 with one float32 scale per token (128 + 4 = 132 B): 788 B, 48,068 B
  over V3.2's 61 layers. FlashMLA's dense decoding kernel reads BF16 only, its sparse one
  FP8 only (README support matrix), so DeepSeek serves V3 from the BF16 row and V3.2 from
  this one (:func:`serving_kv_layout`).

The concurrency bound C_max = (M_total - M_weights - M_act) / (S * KV_per_token) is a
ratio of bytes, so it has no unit; the unit matters only when a memory figure is typed as a
number ("75 GB"): :func:`concurrency_bound` takes that unit explicitly.
"""

from __future__ import annotations

from typing import Optional

from pdjax.arguments import check_int, check_nonnegative, check_positive
from pdjax.analysis.units import unit_bytes
from pdjax.model_config import ModelConfig

#: Attention kinds the KV accounting knows: "mla", "mha", "gqa" (needs num_kv_groups), "mqa".
ATTENTION_KINDS = ("mla", "mha", "gqa", "mqa")
#: Layouts of an MLA row (see the module docstring).
KV_LAYOUTS = ("uniform", "deepseek-fp8")

# DeepSeek's FP8 layout, as its repositories state it (facts, not code):
# * deepseek-ai/FlashMLA README.md at 9241ae3, "FP8 KV Cache": "each token's KV cache is 656
#   Bytes": "First 512 bytes: ... 512 float8_e4m3 values", "Next 16 bytes: Scale factors,
#   containing 4 float32 values. The first float32 is the scale for the first 128
#   float8_e4m3 values, the second for the next 128, and so on", "Last 128 bytes: The RoPE
#   part, containing 64 bfloat16 values. This part is not quantized for accuracy";
#   docs/20250929-hopper-fp8-sparse-deep-dive.md: "tile-level quantization (with a tile size
#   of 1 x 128) to the first 512 elements", "each token's KVCache occupies 656 bytes".
#   Support matrix: "Dense Decoding | SM90 | MQA | BF16", "Sparse Decoding | SM90 & SM100 |
#   MQA | FP8".
# * deepseek-ai/DeepSeek-V3.2-Exp inference/model.py at 3b99a53, class Indexer: the key cache
#   ``k_cache`` is float8_e4m3fn of ``index_head_dim`` per token and ``k_scale_cache`` float32 of
#   ``index_head_dim // block_size`` per token, ``block_size = 128`` (one scale for V3.2's
#   128-wide key); inference/kernel.py ``fp8_index`` takes ``k_s`` of shape (b, n): one scale
#   per key. deepseek-ai/DeepGEMM tests/test_attention.py at 54e2261, the paged indexer cache:
#   ``head_dim + 4`` bytes per token (FP8 key, then its float32 scale).
FP8_TILE = 128            # values per float32 scale (the latent's tiles; the indexer key's block)
FP8_SCALE_BYTES = 4       # a float32 scale
ROPE_BYTES = 2            # the RoPE part stays BF16


def kv_heads(cfg: ModelConfig, attention: str, num_kv_groups: Optional[int] = None) -> int:
    """Number of K/V heads cached per layer for ``attention`` ("mha", "gqa", "mqa");
    MLA caches a shared latent instead and has none (returns 0)."""
    attention = check_attention(attention)
    h = cfg.num_attention_heads
    if attention == "gqa":
        if num_kv_groups is None:
            raise ValueError("attention='gqa' needs num_kv_groups (the number of K/V heads)")
        g = check_int("num_kv_groups", num_kv_groups)
        if g > h or h % g:
            raise ValueError(f"num_kv_groups={g} must divide num_attention_heads={h}")
        return g
    if num_kv_groups is not None:
        raise ValueError(f"num_kv_groups is only meaningful for attention='gqa', not {attention!r}")
    return {"mha": h, "mqa": 1, "mla": 0}[attention]


def check_attention(attention: str) -> str:
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention kind {attention!r}; known: {ATTENTION_KINDS}")
    return attention


def kv_elements_per_token(cfg: ModelConfig, attention: str = "mla",
                          num_kv_groups: Optional[int] = None) -> int:
    """Cached values per token over all layers (elements, not bytes)."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"expected a ModelConfig, got {type(cfg).__name__}")
    heads = kv_heads(cfg, attention, num_kv_groups)
    if attention == "mla":
        per_layer = cfg.kv_latent_dim            # d_c + d_R (+ the indexer key with DSA)
    else:
        per_layer = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # 2 * n_kv * d_h
    return per_layer * cfg.num_hidden_layers


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: float = 2, attention: str = "mla",
                       num_kv_groups: Optional[int] = None, *, layout: str = "uniform") -> float:
    """KV-cache bytes per token over all layers; ``dtype_bytes`` per cached element
    (bf16 2, fp8 1). V3 MLA bf16: 70,272 B; the MHA counterfactual: 3,997,696 B; V3.2
    (the indexer key beside the latent): 85,888 B. ``layout="deepseek-fp8"`` (MLA only):
    DeepSeek's kernels' layout, :func:`kv_row_bytes` x layers (``dtype_bytes`` unused):
    V3.2 48,068 B."""
    check_positive("dtype_bytes", dtype_bytes)
    if check_layout(layout) == "deepseek-fp8":
        if check_attention(attention) != "mla" or num_kv_groups is not None:
            raise ValueError(f"layout='deepseek-fp8' is an MLA row; attention={attention!r} has none")
        return kv_row_bytes(cfg, layout)["total"] * cfg.num_hidden_layers
    n = kv_elements_per_token(cfg, attention, num_kv_groups) * dtype_bytes
    return int(n) if float(n).is_integer() else n


def check_layout(layout: str) -> str:
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; known: {KV_LAYOUTS}")
    return layout


def kv_row_bytes(cfg: ModelConfig, layout: str = "deepseek-fp8", dtype_bytes: float = 2) -> dict:
    """One token's MLA row in one layer, by part (bytes): ``latent``, ``latent_scales``,
    ``rope``, ``index_key``, ``index_scale``, ``mla`` (what the attention reads: the first
    three), ``indexer`` (the last two, 0 without DSA) and ``total``. ``"uniform"``: every value
    ``dtype_bytes``, no scales. ``"deepseek-fp8"`` (the module docstring's sources): C FP8 values
    and a float32 scale per 128 of them, R BF16 values, the indexer key's Di FP8 values and a
    float32 scale per 128 (one for V3.2); V3.2: 512 + 16 + 128 + 128 + 4 = 788. ValueError if C
    or Di is not a multiple of the 128-value tile."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"expected a ModelConfig, got {type(cfg).__name__}")
    check_positive("dtype_bytes", dtype_bytes)
    C, R, Di = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim if cfg.sparse_attention else 0
    if check_layout(layout) == "uniform":
        row = {"latent": C * dtype_bytes, "latent_scales": 0, "rope": R * dtype_bytes,
               "index_key": Di * dtype_bytes, "index_scale": 0}
    else:
        for name, width in (("kv_lora_rank", C), ("index_head_dim", Di)):
            if width % FP8_TILE:
                raise ValueError(f"layout='deepseek-fp8' quantizes in tiles of {FP8_TILE} values; "
                                 f"{name}={width} is not a multiple")
        row = {"latent": C, "latent_scales": C // FP8_TILE * FP8_SCALE_BYTES, "rope": R * ROPE_BYTES,
               "index_key": Di, "index_scale": Di // FP8_TILE * FP8_SCALE_BYTES}
    row["mla"] = row["latent"] + row["latent_scales"] + row["rope"]
    row["indexer"] = row["index_key"] + row["index_scale"]
    row["total"] = row["mla"] + row["indexer"]
    return row


def serving_kv_layout(cfg: ModelConfig) -> tuple[str, float]:
    """(layout, dtype_bytes) of the row DeepSeek's released decode kernels read: BF16
    (``"uniform"``, 2) for dense MLA (FlashMLA's dense decoding reads BF16 only), and with
    DSA ``"deepseek-fp8"`` (its sparse decoding reads FP8 only)."""
    return ("deepseek-fp8", 1) if cfg.sparse_attention else ("uniform", 2)


def serving_kv_bytes_per_token(cfg: ModelConfig) -> float:
    """KV bytes per token over all layers in :func:`serving_kv_layout`: V3 70,272 (BF16),
    V3.2 48,068 (FP8 latent and indexer key with their scales, BF16 RoPE part)."""
    layout, p = serving_kv_layout(cfg)
    return kv_bytes_per_token(cfg, p, layout=layout)


def kv_bytes_per_sequence(cfg: ModelConfig, context_len: int, dtype_bytes: float = 2,
                          attention: str = "mla", num_kv_groups: Optional[int] = None) -> float:
    """KV-cache bytes of one sequence of ``context_len`` tokens."""
    check_int("context_len", context_len)
    return context_len * kv_bytes_per_token(cfg, dtype_bytes, attention, num_kv_groups)


def concurrency_bound(free_memory: float, context_len: int, kv_bytes_per_token: float,
                      *, unit: str) -> float:
    """C_max: how many sequences of ``context_len`` tokens fit in ``free_memory``.

    ``free_memory`` = M_total - M_weights - M_act, as a number in ``unit`` ("B", "GB",
    "GiB", ...): the unit is required because "75 GB" and "75 GiB" differ by 7.4 %, which
    is the source articles' 3.76 (decimal) vs 4.04 (binary) sequences. ``kv_bytes_per_token`` is in
    bytes. Returns a (fractional) number of sequences."""
    free = check_nonnegative("free_memory", free_memory) * unit_bytes(unit)
    check_int("context_len", context_len)
    check_positive("kv_bytes_per_token", kv_bytes_per_token)
    return free / (context_len * kv_bytes_per_token)


def concurrency_bound_both_units(free_memory: float, context_len: int,
                                 kv_bytes_per_token: float) -> dict:
    """C_max for the same nominal free-memory figure read in decimal and in binary units:
    ``{"GB": ..., "GiB": ...}``. The two differ by 2**30 / 1e9 = 1.0737; report one."""
    return {u: concurrency_bound(free_memory, context_len, kv_bytes_per_token, unit=u)
            for u in ("GB", "GiB")}


def free_memory_bytes(hbm_bytes: float, weight_bytes: float, act_bytes: float = 0.0) -> float:
    """M_total - M_weights - M_act in bytes; ValueError if the weights and activations do
    not fit."""
    check_positive("hbm_bytes", hbm_bytes)
    check_nonnegative("weight_bytes", weight_bytes)
    check_nonnegative("act_bytes", act_bytes)
    free = hbm_bytes - weight_bytes - act_bytes
    if free <= 0:
        raise ValueError(f"weights ({weight_bytes:.4g} B) + activations ({act_bytes:.4g} B) do not "
                         f"fit in {hbm_bytes:.4g} B of device memory")
    return free


def kv_handoff_time(context_len: int, kv_bytes_per_token: float, link_bw: float) -> float:
    """Seconds to push one request's KV (``context_len`` tokens) over a link of ``link_bw``
    bytes/s: t = S * KV_per_token / BW_net (ignores latency and protocol overhead)."""
    check_int("context_len", context_len)
    check_positive("kv_bytes_per_token", kv_bytes_per_token)
    check_positive("link_bw", link_bw)
    return context_len * kv_bytes_per_token / link_bw


def prefill_compute_time(context_len: int, active_params: float, peak_flops: float) -> float:
    """Seconds of weight FLOPs to prefill ``context_len`` tokens at peak:
    2 * N_a * S / R_peak (the S^2 attention FLOPs are left out, as in the source articles)."""
    check_int("context_len", context_len)
    check_positive("active_params", active_params)
    check_positive("peak_flops", peak_flops)
    return 2 * active_params * context_len / peak_flops


def handoff_to_prefill_ratio(kv_bytes_per_token: float, active_params: float,
                             peak_flops: float, link_bw: float) -> float:
    """t_comm / t_comp = KV_per_token * R_peak / (2 * N_a * BW_net), independent of S.
    DeepSeek-V3 on H800 (989 TFLOP/s, 37 B active, 50 GB/s IB): ~1.9 %."""
    check_positive("kv_bytes_per_token", kv_bytes_per_token)
    check_positive("active_params", active_params)
    check_positive("peak_flops", peak_flops)
    check_positive("link_bw", link_bw)
    return kv_bytes_per_token * peak_flops / (2 * active_params * link_bw)


def link_bw_for_handoff_ratio(target_ratio: float, kv_bytes_per_token: float,
                              active_params: float, peak_flops: float) -> float:
    """The link bandwidth (bytes/s) at which t_comm / t_comp equals ``target_ratio``; any
    slower link makes the handoff cost more than that fraction of the prefill."""
    check_positive("target_ratio", target_ratio)
    return handoff_to_prefill_ratio(kv_bytes_per_token, active_params, peak_flops, 1.0) / target_ratio
