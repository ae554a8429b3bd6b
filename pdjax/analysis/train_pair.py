"""The prediction of one DualPipe forward & backward chunk pair: what DeepSeek's train.json
captures (DeepSeek-V3, 4 MoE layers each way, EP64, 4K tokens per micro-batch, H800), so
the op model can be held against the trace kernel class by kernel class.

Forward parts are the inference ops (:mod:`pdjax.analysis.opmodel`). The backward:

* input gradients: each forward GEMM's transpose (M tokens, N = K, K = N), the expert
  GEMMs grouped, plus the recomputation DeepSeek-V3 does in the backward (its MLA
  up-projections q_b and kv_b, report sec. 3.2.3); FlashAttention's backward (2.5x the
  forward FLOPs at its own train.json efficiency);
* weight gradients: the same FLOPs as the forward GEMMs; their kernels (DeepSeek's internal
  ``fp8_dptp128c_acc``, not in any DeepGEMM table) reach a share of the forward kernels'
  speed that only train.json shows, so that share is calibrated there;
* "other" backward kernels: their per-token time in train.json.

The all-to-alls: the backward of a combine is an FP8 dispatch, of a dispatch a BF16
combine (what train.json's comm stream runs). DeepEP's kernels hold 20 of 132 SMs.
"""

from __future__ import annotations

import dataclasses
import functools

from pdjax import configs
from pdjax.analysis import calibration as C
from pdjax.analysis.kernels import KernelModel, causal_attention_flops, train_calibration
from pdjax.analysis.layer_gemms import attention_gemms, moe_gemms
from pdjax.analysis.opmodel import Part, a2a_parts, attention_part, gemm_time, moe_parts
from pdjax.analysis.overlap import PairParts, dualpipe_pair_program, run
from pdjax.analysis.routing import route_stats
from pdjax.analysis.streams import class_times, makespan
from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig

#: The GEMM speeds train.json's kernels ran at: its forward GEMMs (DeepSeek's internal
#: dpsk::grouped_gemm kernels, Feb 2025) match DeepGEMM's first release within a few per cent.
TRACE_KERNELS = "deepgemm-2025-02"
#: The GEMMs DeepSeek-V3 recomputes in the backward (its MLA up-projections, report sec. 3.2.3).
RECOMPUTED = ("q_b", "kv_b")


def _gemms(km: KernelModel, gemms, rows: dict, transpose: bool, slots: int = 1) -> float:
    """Seconds of ``gemms`` in their forward shapes, or (``transpose``) with N and K swapped
    for the input gradients."""
    return gemm_time(km, [g.transposed() for g in gemms] if transpose else gemms, rows, slots=slots)


def _dense_gemms(km: KernelModel, cfg: ModelConfig, tokens: int, transpose: bool) -> float:
    """Seconds of one layer's attention projection and shared-expert GEMMs (the naive form
    on one ``tokens``-token sequence; no router)."""
    gemms = attention_gemms(cfg, "naive") + tuple(g for g in moe_gemms(cfg) if g.block == "shared")
    return _gemms(km, gemms, {"token": tokens, "attended": tokens}, transpose)


def _expert_gemms(km: KernelModel, cfg: ModelConfig, tokens: int, ep: int, slots: int, transpose: bool) -> float:
    """Seconds of one layer's routed-expert GEMMs on one GPU (grouped over its slots)."""
    gemms = [g for g in moe_gemms(cfg) if g.block == "routed"]
    return _gemms(km, gemms, {"routed": tokens * cfg.num_experts_per_tok}, transpose, slots // ep)


@functools.lru_cache(maxsize=None)
def wgrad_speed() -> float:
    """Weight-gradient GEMM speed as a share of the forward-shaped GEMMs of the same FLOPs
    on DeepSeek's Feb 2025 kernels, from train.json (its mlp(W) and attn(W) GEMM time)."""
    raw, cfg = C.TRAIN_PROFILE_RAW, configs.deepseek_v3()
    km = KernelModel("h800", TRACE_KERNELS)
    tokens = raw["tokens"]
    model = raw["layers"] * (_dense_gemms(km, cfg, tokens, False)
                             + _expert_gemms(km, cfg, tokens, 64, cfg.n_routed_experts, False))
    return model / (raw["wgrad_us"] * 1e-6)


@dataclasses.dataclass(frozen=True)
class PairPrediction:
    """A predicted chunk pair: ``spans`` (its timeline), ``op_times`` (seconds per class),
    ``makespan_s``."""

    spans: list
    op_times: dict
    makespan_s: float


def comm_factors() -> tuple[float, float]:
    """(dispatch, combine): train.json's dispatch and combine kernel time over the same
    kernels' unit-benchmark time (DeepEP's tables) in this pair: how much longer DeepEP's
    normal kernels run inside an overlapped schedule (waiting on peers, sharing HBM)."""
    raw = C.TRAIN_PROFILE_RAW
    unit = _unit_pair()
    return (raw["class_us"]["dispatch"] * 1e-6 / unit.op_times["dispatch"],
            raw["class_us"]["combine"] * 1e-6 / unit.op_times["combine"])


@functools.lru_cache(maxsize=None)
def _unit_pair() -> "PairPrediction":
    return predict_train_pair(configs.deepseek_v3(), comm_factor=(1.0, 1.0))


def predict_train_pair(cfg: ModelConfig, hw="h800", *, layers: int = 4, tokens: int = 4096, ep: int = 64,
                       gpus_per_node: int = 8, gemm_kernels: str = TRACE_KERNELS,
                       comm_factor=None) -> PairPrediction:
    """One DualPipe F&B chunk pair of ``layers`` MoE layers, ``tokens`` tokens per micro-batch
    (one sequence) on each of ``ep`` GPUs (balanced routing, as DeepSeek profiled).
    ``comm_factor``: (dispatch, combine) stretch of the all-to-all over its unit benchmark
    (default :func:`comm_factors`; (1, 1) for the unit-benchmark times)."""
    check_int("layers", layers)
    check_int("tokens", tokens)
    km = KernelModel(hw, gemm_kernels)
    cal, raw = train_calibration(), C.TRAIN_PROFILE_RAW
    slots = cfg.n_routed_experts
    stats = route_stats(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, ep,
                        gpus_per_node, tokens, samples=1)
    chunks = [(tokens, 0)]
    attn_f = attention_part(km, cfg, chunks=chunks, training=True)
    shared, experts = moe_parts(km, cfg, tokens, ep=ep, slots=slots, imbalance=1.0, training=True)
    disp, comb = a2a_parts(km, cfg, tokens, ep=ep, stats=stats, kernels="normal",
                           intranode=ep <= km.hw_domain, imbalance=1.0)
    kd, kc = comm_factors() if comm_factor is None else comm_factor
    disp, comb = Part(comm=disp.comm * kd), Part(comm=comb.comm * kc)
    recompute = _gemms(km, [g for g in attention_gemms(cfg, "naive") if g.name in RECOMPUTED],
                       {"token": tokens, "attended": tokens}, False)
    dense_dgrad, routed_dgrad = _dense_gemms(km, cfg, tokens, True), _expert_gemms(km, cfg, tokens, ep, slots, True)
    other_b = (raw["class_us"]["other"] - raw["other_fwd_us"]) * 1e-6 / raw["layers"] * tokens / raw["tokens"]
    other_b /= km.hbm_scale
    dense_w, routed_w = _dense_gemms(km, cfg, tokens, False), _expert_gemms(km, cfg, tokens, ep, slots, False)
    w = 1.0 / wgrad_speed()
    parts = PairParts(
        attn_f=attn_f, mlp_f=shared + experts, dispatch_f=disp, combine_f=comb,
        attn_b=Part(gemm=dense_dgrad + recompute,
                    attention=km.attention_prefill(causal_attention_flops(cfg, chunks), backward=True),
                    other=other_b / 2),
        mlp_b=Part(gemm=routed_dgrad, other=other_b / 2),
        combine_b=disp, dispatch_b=comb,
        attn_w=Part(gemm=dense_w * w), mlp_w=Part(gemm=routed_w * w))
    spans = run(dualpipe_pair_program([parts] * layers), comm_sm_share=cal["comm_sm_share"])
    return PairPrediction(spans, class_times(spans), makespan(spans))
