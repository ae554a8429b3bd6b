"""The coefficients of :meth:`pdjax.sim.cost.LinearStepCost.from_roofline` (its docstring says
what each one is): a roofline of a config on ``ep_size`` accelerators, with DeepSeek-V3.2's
sparse attention when the config has it (:mod:`pdjax.analysis.sparse_attention`)."""

from __future__ import annotations

from typing import Optional

from pdjax.arguments import check_int
from pdjax.analysis import hardware, kv_bytes_per_token, param_counts
from pdjax.analysis.hardware import normalise_dtype
from pdjax.analysis.kv import free_memory_bytes, kv_row_bytes
from pdjax.analysis.roofline import attention_flops_per_token
from pdjax.analysis.sparse_attention import LOGIT_BYTES, attention_flops_per_pair, indexer_flops_per_pair


def roofline_fields(cfg, hw, dtype: str, dtype_bytes: Optional[float], kv_dtype_bytes: Optional[float],
                    ep_size: int, mfu: float, mbu: float, kv_layout: str = "uniform") -> dict:
    """The :class:`~pdjax.sim.cost.LinearStepCost` fields of ``from_roofline``'s arguments."""
    hw = hardware(hw)
    dtype = normalise_dtype(dtype)
    p = dtype_bytes if dtype_bytes is not None else (1 if dtype == "fp8" else 2)
    kvp = kv_dtype_bytes if kv_dtype_bytes is not None else p
    _check_roofline_scales(ep_size, mfu, mbu)
    peak = ep_size * hw.peak_flops(dtype) * mfu
    bw = ep_size * hw.require("hbm_bw", "the linear step-cost model") * mbu
    counts = param_counts(cfg)
    ffn_total = counts.routed_experts + counts.shared_experts + counts.dense_mlp
    ffn_active = counts.routed_active + counts.shared_experts + counts.dense_mlp
    attn_resident = counts.total - ffn_total             # incl. embedding and head
    attn_read = attn_resident - (0 if cfg.tie_word_embeddings else counts.embedding)
    attn_active = counts.active - ffn_active
    kv_b = kv_bytes_per_token(cfg, dtype_bytes=kvp, attention="mla", layout=kv_layout)
    pair_flops = attention_flops_per_token(cfg, 1) * cfg.num_hidden_layers
    c2 = pair_flops / peak
    attn = dict(c2=c2, c3=c2 / 2, d2=max(kv_b / bw, c2))
    if cfg.sparse_attention:
        attn = _sparse_fields(cfg, kv_row_bytes(cfg, kv_layout, kvp), peak, bw)
    capacity, capacity_attn = _kv_capacities(hw, ep_size, counts.total * p, attn_resident * p, kv_b)
    return dict(
        c0=(attn_read + ffn_total) * p / bw, c1=2 * counts.active / peak,
        c4=kv_b / bw, a0=attn_read * p / bw, a1=2 * attn_active / peak,
        f0=ffn_total * p / bw, f1=2 * ffn_active / peak, **attn,
        kv_bytes=int(kv_b), num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
        act_bytes=int(p), experts_per_token=max(1, cfg.num_experts_per_tok),
        kv_capacity=capacity, kv_capacity_attention=capacity_attn, cfg=cfg,
        note=f"roofline of {cfg.model_type} on {ep_size} x {hw.name} {dtype}, "
             f"mfu={mfu:g}, mbu={mbu:g}" + (f", sparse attention top-{cfg.index_topk}" if cfg.sparse_attention else ""))


def _sparse_fields(cfg, row: dict, peak: float, bw: float) -> dict:
    """c2, c3, d2 (the indexer: every pair) and c5, d3 (the sparse attention: the selected
    pairs) of a DSA config over all layers, rows of ``row`` bytes."""
    L = cfg.num_hidden_layers
    c2 = indexer_flops_per_pair(cfg) * L / peak
    c5 = attention_flops_per_pair(cfg) * L / peak
    return dict(c2=c2, c3=c2 / 2, d2=max((row["indexer"] + LOGIT_BYTES) * L / bw, c2),
                c5=c5, d3=max(row["mla"] * L / bw, c5), sparse_topk=cfg.index_topk)


def _check_roofline_scales(ep_size, mfu, mbu) -> None:
    """The scale arguments of :meth:`LinearStepCost.from_roofline`: ``ep_size`` a positive
    integer, ``mfu`` and ``mbu`` in (0, 1]; ValueError naming the first that is not."""
    check_int("ep_size", ep_size)
    for name, v in (("mfu", mfu), ("mbu", mbu)):
        if not (0 < v <= 1):
            raise ValueError(f"{name} must lie in (0, 1], got {v!r}")


def _kv_capacities(hw, ep_size: int, weight_bytes: float, attn_weight_bytes: float,
                   kv_b: float) -> tuple[Optional[float], Optional[float]]:
    """KV tokens that ``ep_size`` accelerators ``hw`` hold after all the weights
    (``weight_bytes``) and after the attention-side weights only (``attn_weight_bytes``),
    at ``kv_b`` bytes per token; each None when the weights do not fit or the hardware
    publishes no HBM size."""
    capacity = capacity_attn = None
    if hw.hbm_bytes is not None:
        hbm = ep_size * hw.hbm_bytes
        if hbm > weight_bytes:
            capacity = free_memory_bytes(hbm, weight_bytes) / kv_b
        if hbm > attn_weight_bytes:
            capacity_attn = free_memory_bytes(hbm, attn_weight_bytes) / kv_b
    return capacity, capacity_attn


