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
is not carried over. MLA caches ``kv_lora_rank + qk_rope_head_dim`` (= d_c + d_R) values.

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
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim          # d_c + d_R
    else:
        per_layer = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # 2 * n_kv * d_h
    return per_layer * cfg.num_hidden_layers


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: float = 2, attention: str = "mla",
                       num_kv_groups: Optional[int] = None) -> float:
    """KV-cache bytes per token over all layers; ``dtype_bytes`` per cached element
    (bf16 2, fp8 1). V3 MLA bf16: 70,272 B; the MHA counterfactual: 3,997,696 B."""
    check_positive("dtype_bytes", dtype_bytes)
    n = kv_elements_per_token(cfg, attention, num_kv_groups) * dtype_bytes
    return int(n) if float(n).is_integer() else n


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
