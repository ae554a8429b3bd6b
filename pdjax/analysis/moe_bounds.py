"""MoE sparsity arithmetic: the MFU bound k/E, tokens per expert, and EP weight bytes.

Top-k routing over E experts splits a batch of B tokens so each expert sees B * k / E on
average. At the balance batch B* (the batch at which a dense layer just reaches A*), an
expert's GEMM therefore runs at intensity (k/E) * A*, and its compute utilisation is at
most k / E (MegaScale-Infer's example: 8 experts, top-2 -> 25 %; 156 * 2 / 8 = 39 tokens
per expert on A100). Every expert reaches the balance point only at B* * E / k tokens.
"""

from __future__ import annotations

from typing import Optional

from pdjax.analysis.hardware import HardwareLike
from pdjax.param_counts import param_counts
from pdjax.analysis.roofline import compute_bound_batch
from pdjax.arguments import check_int, check_positive
from pdjax.model_config import ModelConfig

EP_LAYOUTS = ("even", "replicated")


def _require_moe(cfg: ModelConfig) -> None:
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"expected a ModelConfig, got {type(cfg).__name__}")
    if cfg.n_routed_experts <= 0:
        raise ValueError("config has no routed experts (n_routed_experts=0): no MoE bound")


def moe_mfu_bound(cfg: ModelConfig) -> float:
    """Upper bound on routed-expert MFU at the balance batch: num_experts_per_tok /
    n_routed_experts (8 experts top-2: 0.25; DeepSeek-V3: 8/256 = 0.031)."""
    _require_moe(cfg)
    return cfg.num_experts_per_tok / cfg.n_routed_experts


def tokens_per_expert(cfg: ModelConfig, batch_tokens: float) -> float:
    """Mean tokens each routed expert receives from a batch: B * k / E."""
    check_positive("batch_tokens", batch_tokens)
    return batch_tokens * moe_mfu_bound(cfg)


def tokens_per_expert_at_balance(cfg: ModelConfig, hw: HardwareLike, dtype: str = "bf16",
                                 weight_dtype_bytes: Optional[float] = None) -> float:
    """Tokens per expert when the batch is the dense balance batch of ``hw``:
    B* * k / E (A100, 8 experts top-2: 156 * 2 / 8 = 39 with the 2 TB/s rounding)."""
    return tokens_per_expert(cfg, compute_bound_batch(hw, dtype, weight_dtype_bytes))


def expert_balance_batch(cfg: ModelConfig, hw: HardwareLike, dtype: str = "bf16",
                         weight_dtype_bytes: Optional[float] = None) -> float:
    """Tokens per forward (over the whole EP group) for the mean expert to reach the
    balance point: B* * E / k."""
    return compute_bound_batch(hw, dtype, weight_dtype_bytes) / moe_mfu_bound(cfg)


def check_ep_size(cfg: ModelConfig, ep_size) -> int:
    """``ep_size`` as an int >= 1 that, for a MoE ``cfg``, does not exceed its routed experts
    per layer: each EP rank holds at least one routed expert of every MoE layer. More ranks
    than experts would hold replicas (EPLB's redundant experts), which the EP accounting
    here does not model, so they are refused. Returns ``ep_size``."""
    ep_size = check_int("ep_size", ep_size)
    if cfg.n_routed_experts and ep_size > cfg.n_routed_experts:
        raise ValueError(f"ep_size: must not exceed the routed experts per layer (n_routed_experts = "
                         f"{cfg.n_routed_experts}), got {ep_size}: each EP rank holds at least one routed expert "
                         "of every MoE layer (replicas, as EPLB's redundant experts, are not modelled)")
    return ep_size


def ep_weight_bytes_per_gpu(cfg: ModelConfig, ep_size: int, dtype_bytes: float = 1,
                            layout: str = "even", mtp_layers: int = 0) -> float:
    """Weight bytes each of ``ep_size`` expert-parallel ranks holds (``dtype_bytes`` per
    parameter, fp8 = 1).

    ``layout="even"``: the whole model split evenly, total * p / EP: the source articles'
    671 GB / 144 = 4.7 GB. ``layout="replicated"``: routed experts split over EP, everything
    else (attention, shared experts, dense layers, embeddings: data-parallel in DeepSeek's
    decode deployment) replicated on every rank: routed * p / EP + non_routed * p
    (DeepSeek-V3 fp8 EP144: ~21.7 GB). Redundant experts (EPLB) are not counted, so an
    ``ep_size`` above the routed experts per layer is a ValueError (:func:`check_ep_size`):
    either layout then holds at least one routed expert of each MoE layer per rank.
    """
    ep_size = check_ep_size(cfg, ep_size)
    check_positive("dtype_bytes", dtype_bytes)
    if layout not in EP_LAYOUTS:
        raise ValueError(f"unknown EP layout {layout!r}; known: {EP_LAYOUTS}")
    counts = param_counts(cfg, mtp_layers=mtp_layers)
    total = counts.total + counts.mtp
    if layout == "even":
        return total * dtype_bytes / ep_size
    # the MTP modules' routed experts split like any MoE layer's
    routed = counts.routed_experts + counts.mtp_layers * cfg.n_routed_experts * 3 * cfg.hidden_size * \
        cfg.moe_intermediate_size
    return (routed / ep_size + (total - routed)) * dtype_bytes


def smallest_fitting_ep(cfg: ModelConfig, memory_bytes: float, dtype_bytes: float = 1, layout: str = "even",
                        reserved_bytes: float = 0.0, mtp_layers: int = 0) -> int:
    """The smallest EP size at which a rank's weights (:func:`ep_weight_bytes_per_gpu`; a
    dense model: total / EP) fit in ``memory_bytes`` with ``reserved_bytes`` kept free. EP
    sizes tried: the divisors of the routed experts per layer (every rank the same number of
    experts), a dense model's powers of two up to 1024. None fits: the largest tried.
    ``mtp_layers``: MTP modules held too (speculative decoding on)."""
    check_positive("memory_bytes", memory_bytes)
    if cfg.n_routed_experts:
        sizes = [d for d in range(1, cfg.n_routed_experts + 1) if cfg.n_routed_experts % d == 0]
        held = lambda ep: ep_weight_bytes_per_gpu(cfg, ep, dtype_bytes, layout, mtp_layers)   # noqa: E731
    else:
        sizes = [2 ** k for k in range(11)]
        counts = param_counts(cfg, mtp_layers=mtp_layers)
        total = (counts.total + counts.mtp) * check_positive("dtype_bytes", dtype_bytes)
        held = lambda ep: total / ep                                                # noqa: E731
    return next((ep for ep in sizes if held(ep) + reserved_bytes < memory_bytes), sizes[-1])


def decode_batch_for_context(kv_token_capacity: float, context_len: float) -> float:
    """Sequences of ``context_len`` tokens that fit a KV capacity of ``kv_token_capacity``
    tokens: B = capacity / S, so B ∝ 1/S (Qwen3-235B on GB200, 808,704 tokens per rank:
    395 at 2K, 197 at 4K, 6 at 128K)."""
    check_positive("kv_token_capacity", kv_token_capacity)
    check_positive("context_len", context_len)
    return kv_token_capacity / context_len
