"""Roofline arithmetic: intensity of the weight matmuls and of attention vs machine balance.

Units: arithmetic intensity and machine balance in FLOP per byte of HBM traffic.

* Weights: a forward over B tokens does 2 * N_a * B FLOPs and reads N_a * p bytes of
  weights, so A = 2B / p (= B in bf16), independent of the model.
* Machine balance: A* = R_peak / BW_HBM. Below A* a kernel is bandwidth-bound and uses at
  most A / A* of the compute; decode at B = 1 in bf16 (A = 1) uses ~0.3 % of an H100.
* Attention over S cached tokens, per new token: 4 * n_h * d_h * S FLOPs (QK^T and PV).
  MHA reads 2 * S * n_h * d_h * p bytes of K/V (A = 2/p), GQA 2 * S * n_g * d_h * p
  (A = 2 n_h / (n_g p)), MQA 2 * S * d_h * p, MLA (absorbed) (d_c + d_R) * S * p:
  A = 4 n_h d_h / ((d_c + d_R) p), ~56.9 FLOP/B for DeepSeek-V3 in bf16.
"""

from __future__ import annotations

from typing import Optional

from pdjax.analysis.hardware import HardwareLike, dtype_bytes as _dtype_size, hardware, normalise_dtype
from pdjax.analysis.kv import kv_elements_per_token
from pdjax.arguments import check_nonnegative, check_positive
from pdjax.model_config import ModelConfig


def weight_intensity(batch_tokens: float, dtype_bytes: float = 2) -> float:
    """FLOP per weight byte of a forward over ``batch_tokens`` tokens: A = 2B / p."""
    check_positive("batch_tokens", batch_tokens)
    check_positive("dtype_bytes", dtype_bytes)
    return 2 * batch_tokens / dtype_bytes


def machine_balance(hw: HardwareLike, dtype: str = "bf16") -> float:
    """A* = dense peak FLOP/s of ``dtype`` / HBM bytes/s (FLOP per byte).
    H100 SXM: 295 (bf16), 591 (fp8); A100: 153 (156 with MegaScale-Infer's 2 TB/s); H200: 206."""
    hw = hardware(hw)
    dtype = normalise_dtype(dtype)
    return hw.peak_flops(dtype) / hw.require("hbm_bw", "machine balance")


def utilisation_bound(intensity: float, balance: float) -> float:
    """Largest fraction of peak compute a kernel of ``intensity`` FLOP/B can use on a
    machine of ``balance`` FLOP/B: min(1, A / A*)."""
    check_nonnegative("intensity", intensity)
    check_positive("balance", balance)
    return min(1.0, intensity / balance)


def decode_utilisation_bound(hw: HardwareLike, batch_tokens: float = 1, dtype: str = "bf16",
                             weight_dtype_bytes: Optional[float] = None) -> float:
    """Compute fraction usable by the weight matmuls of a decode step of ``batch_tokens``
    sequences (one token each): min(1, (2B/p) / A*). ``weight_dtype_bytes`` defaults to the
    element size of ``dtype``. H100 bf16, B = 1: ~0.34 %."""
    p = weight_dtype_bytes if weight_dtype_bytes is not None else _dtype_size(dtype)
    return utilisation_bound(weight_intensity(batch_tokens, p), machine_balance(hw, dtype))


def compute_bound_batch(hw: HardwareLike, dtype: str = "bf16",
                        weight_dtype_bytes: Optional[float] = None) -> float:
    """Concurrent decode sequences per accelerator for the weight matmuls to reach the
    balance point: 2B/p >= A*  =>  B >= A* * p / 2 (= A* in bf16; ~295 on H100)."""
    p = weight_dtype_bytes if weight_dtype_bytes is not None else _dtype_size(dtype)
    check_positive("weight_dtype_bytes", p)
    return machine_balance(hw, dtype) * p / 2


def attention_flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """FLOPs of one new token attending to ``context_len`` cached tokens:
    2 * n_h * S * (d_qk + d_v) (= 4 n_h d_h S with d_h = 128; RoPE dims left out as in
    the source articles, so every attention kind does the same FLOPs)."""
    check_positive("context_len", context_len)
    return 2 * cfg.num_attention_heads * context_len * (cfg.qk_nope_head_dim + cfg.v_head_dim)


def causal_pairs(q: int, c: int) -> int:
    """(query, key) pairs of q new tokens over c cached ones, each seeing itself (causal):
    q c + q (q + 1) / 2."""
    return q * c + q * (q + 1) // 2


def attention_flops_per_pair(cfg: ModelConfig) -> int:
    """FLOPs of one (query, key) pair of MLA in its absorbed (MQA) form, dense decode's and
    DeepSeek sparse attention's: a (C + R)-wide score and a C-wide value per head,
    2 H (2 C + R) (V3 and V3.2: 278,528)."""
    return 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def attention_intensity(cfg: ModelConfig, attention: str = "mla", dtype_bytes: float = 2,
                        num_kv_groups: Optional[int] = None) -> float:
    """FLOP per KV-cache byte of decode attention (S cancels): MHA 2/p, GQA 2 n_h/(n_g p),
    MQA 2 n_h / p, MLA 4 n_h d_h / ((d_c + d_R) p) (DeepSeek-V3 bf16: 56.9)."""
    check_positive("dtype_bytes", dtype_bytes)
    flops = attention_flops_per_token(cfg, 1) * cfg.num_hidden_layers
    return flops / (kv_elements_per_token(cfg, attention, num_kv_groups) * dtype_bytes)

