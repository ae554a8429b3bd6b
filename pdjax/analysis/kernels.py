"""Kernel times on one GPU from DeepSeek's published kernel measurements
(:mod:`pdjax.analysis.calibration`), carried to any :class:`~pdjax.analysis.HardwareSpec`.

How each measurement enters (H800 is the hardware every table was measured on):

* **GEMM** (DeepGEMM tables). A measured shape's *roofline efficiency* is its H800 roofline
  time over its measured time, where roofline = max(FLOPs / peak, bytes / HBM bw) with FP8
  inputs and BF16 output. A query shape takes the efficiency of the table rows with the
  same (N, K), interpolated in log M per group (clamped outside the measured range; grouped
  rows of both layouts form one curve), or, for a shape DeepGEMM did not measure, the
  curve of all rows of its kind; its time is its own roofline on the target hardware over
  that efficiency. Same efficiency on other hardware is an assumption (exact for H100,
  whose SMs, clocks and HBM equal H800's).
* **Decode attention** (FlashMLA): a roofline through the two printed ceilings, 3,000 GB/s
  and 660 TFLOPS on H800, each scaled by the target's HBM bandwidth and BF16 peak over
  H800's. Two points, not curves.
* **Prefill attention** (FlashAttention-3 forward with MLA's 192/128 head dims, BF16): the
  fraction of BF16 peak it reached in DeepSeek's train.json
  (:data:`~pdjax.analysis.calibration.TRAIN_PROFILE_RAW`).
* **Sparse attention** (DeepSeek-V3.2's DSA, FlashMLA's sparse kernels,
  :data:`~pdjax.analysis.calibration.FLASHMLA_SPARSE`): decode at 410 TFLOPS (topk 2,048;
  460 at topk 32,768, interpolated in log topk and clamped) with its FP8 rows read at the
  dense kernel's 3,000 GB/s; prefill at 640 TFLOPS. Scaled as the dense ones.
* **Lightning indexer** (DSA; no published timing): its traffic as DeepGEMM's benchmark
  counts it (:data:`~pdjax.analysis.calibration.INDEXER_SOURCE`), its FP8 logits at the
  share of peak FlashMLA's sparse prefill reaches (640 / 989 of BF16 peak, applied to the
  FP8 peak: an attention-like kernel at an attention kernel's efficiency, an assumption),
  its bytes at FlashMLA's 3,000 GB/s.
* **Expert all-to-all, normal kernels** (DeepEP internode/intranode): a token crosses RDMA
  once per destination node and NVLink once per destination GPU; the two legs pipeline,
  so a kernel takes max(RDMA bytes / B_rdma, NVLink bytes / B_nvl) plus one chunk of the
  other leg. B_rdma(EP) is the table's bandwidth where its benchmark is RDMA-bound (EP32,
  EP64; held flat beyond), B_nvl of the internode kernels from EP16, where the benchmark
  is NVLink-bound (the table's 43 GB/s times NVLink bytes over RDMA bytes of its own
  routing, :func:`pdjax.analysis.routing.route_stats`). Within one NVLink domain the
  intranode row (153 / 158 GB/s) applies. Other hardware: B_rdma scaled by its NIC over
  50 GB/s, B_nvl by its NVLink over DeepEP's "~160 GB/s" for H800.
* **Expert all-to-all, low-latency kernels** (decode): bytes (every top-k copy, FP8
  dispatch, BF16 combine) over the bandwidth the table implies at that EP (interpolated
  in log EP), so exact at the benchmark's 128 tokens per GPU and linear in bytes around it
  (the fixed latency at a few tokens is not modelled). NIC-scaled on other hardware.
* **Everything else** ("other": casts, norms, RoPE, routing, swiglu): from the forward
  chunk of train.json without the kernels only training needs; the kernels too short to
  stream an activation (<= 5 us at 4,096 tokens) keep their time at any batch, the rest
  scale with tokens and with HBM bandwidth.
"""

from __future__ import annotations

import bisect
import functools
import math
from typing import Sequence

from pdjax.analysis import calibration as C
from pdjax.analysis.hardware import HardwareLike, hardware
from pdjax.analysis.roofline import causal_pairs
from pdjax.analysis.routing import route_stats
from pdjax.arguments import check_int, check_nonnegative

H800 = "h800"


def _interp_log(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear interpolation of ys over log(xs) at log(x), clamped at both ends (xs sorted)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    lx, hx = math.log(xs[i - 1]), math.log(xs[i])
    w = (math.log(x) - lx) / (hx - lx)
    return ys[i - 1] * (1 - w) + ys[i] * w


def gemm_flops_bytes(m: float, n: int, k: int, groups: int = 1, in_bytes: float = 1,
                     out_bytes: float = 2) -> tuple[float, float]:
    """(FLOPs, HBM bytes) of ``groups`` GEMMs of ``m`` rows by an N x K weight each:
    2 m n k per group; the activations, the weights and the output read or written once."""
    return 2.0 * groups * m * n * k, groups * ((m * k + n * k) * in_bytes + m * n * out_bytes)


@functools.lru_cache(maxsize=None)
def _gemm_curves(kernels: str) -> dict:
    """{(kind, n, k) or (kind, None, None): (sorted m, efficiencies)} from the rows of the
    GEMM kernel set ``kernels`` (:data:`pdjax.analysis.calibration.GEMM_KERNELS`); kind is
    "normal" or "grouped"."""
    if kernels not in C.GEMM_KERNELS:
        raise ValueError(f"unknown GEMM kernel set {kernels!r}; known: {sorted(C.GEMM_KERNELS)}")
    table, by_speedup, _ = C.GEMM_KERNELS[kernels]
    h800 = hardware(H800)
    pts: dict = {}
    for p in table:
        kind = "normal" if p.layout == "normal" else "grouped"
        flops, nbytes = gemm_flops_bytes(p.m, p.n, p.k, p.groups)
        roof = max(flops / h800.peak_flops("fp8"), nbytes / h800.hbm_bw)
        tflops = p.tflops / p.speedup if by_speedup else p.tflops
        eff = roof / (flops / (tflops * 1e12))
        for key in ((kind, p.n, p.k), (kind, None, None)):
            pts.setdefault(key, {}).setdefault(p.m, []).append(eff)
    return {key: (sorted(d), [sum(d[m]) / len(d[m]) for m in sorted(d)]) for key, d in pts.items()}


class KernelModel:
    """Kernel times (seconds) on one GPU of ``hw``; see the module docstring."""

    def __init__(self, hw: HardwareLike, gemm_kernels: str = "deepgemm-2025-04"):
        self.hw = hardware(hw)
        _gemm_curves(gemm_kernels)                          # an unknown set fails here
        self.gemm_kernels = gemm_kernels
        h800 = hardware(H800)
        self.hbm_scale = self.hw.require("hbm_bw", "the kernel model") / h800.hbm_bw
        self.bf16_scale = self.hw.peak_flops("bf16") / h800.peak_flops("bf16")
        self.nic_scale = self.hw.require("scale_out_bw", "the expert all-to-all") / (C.DEEPEP_H800_RDMA_GBPS * 1e9)
        self.nvl_scale = self.hw.require("scale_up_bw", "the expert all-to-all") / (C.DEEPEP_H800_NVLINK_GBPS * 1e9)
        self.hw_domain = self.hw.scale_up_domain or 8     # GPUs an all-to-all reaches over NVLink alone

    # ---- GEMM -------------------------------------------------------------------------
    def gemm_efficiency(self, m: float, n: int, k: int, grouped: bool = False) -> float:
        """Roofline efficiency DeepGEMM reached at this shape (see the module docstring)."""
        curves = _gemm_curves(self.gemm_kernels)
        kind = "grouped" if grouped else "normal"
        ms, effs = curves.get((kind, n, k)) or curves[(kind, None, None)]
        return _interp_log(m, ms, effs)

    def gemm(self, m: float, n: int, k: int, *, groups: int = 1, grouped: bool = False,
             dtype: str = "fp8") -> float:
        """Seconds of ``groups`` GEMMs of ``m`` rows (per group) by N x K (FP8 or BF16 inputs)."""
        check_nonnegative("m", m)
        if m == 0:
            return 0.0
        in_bytes = 1 if dtype == "fp8" else 2
        flops, nbytes = gemm_flops_bytes(m, n, k, groups, in_bytes)
        roof = max(flops / self.hw.peak_flops(dtype), nbytes / self.hw.hbm_bw)
        return roof / self.gemm_efficiency(m, n, k, grouped or groups > 1)

    # ---- attention --------------------------------------------------------------------
    def attention_prefill(self, flops: float, backward: bool = False) -> float:
        """Seconds of FlashAttention-style BF16 prefill attention of ``flops`` FLOPs (forward
        matmul FLOPs; the backward runs 2.5x those at its own measured efficiency)."""
        check_nonnegative("flops", flops)
        cal = train_calibration()
        eff = cal["attention_bwd_eff"] if backward else cal["attention_fwd_eff"]
        work = flops * (2.5 if backward else 1.0)
        return work / (self.hw.peak_flops("bf16") * eff)

    def attention_decode(self, flops: float, kv_bytes: float) -> float:
        """Seconds of FlashMLA-style decode attention: max(FLOPs / 660 TFLOPS,
        bytes / 3,000 GB/s) at H800, each ceiling scaled to this hardware."""
        check_nonnegative("flops", flops)
        check_nonnegative("kv_bytes", kv_bytes)
        return max(flops / (C.FLASHMLA_DECODE["compute_tflops"] * 1e12 * self.bf16_scale),
                   kv_bytes / (C.FLASHMLA_DECODE["memory_gbps"] * 1e9 * self.hbm_scale))

    def attention_decode_sparse(self, flops: float, kv_bytes: float, topk: int) -> float:
        """Seconds of FlashMLA's sparse decoding (FP8 rows, BF16 MMAs) at index_topk ``topk``:
        max(FLOPs / (410 TFLOPS at topk 2,048, 460 at 32,768), bytes / 3,000 GB/s) at H800."""
        check_nonnegative("flops", flops)
        check_nonnegative("kv_bytes", kv_bytes)
        check_int("topk", topk)
        pts = sorted(C.FLASHMLA_SPARSE["decode_tflops"].items())
        tflops = _interp_log(topk, [k for k, _ in pts], [t for _, t in pts])
        return max(flops / (tflops * 1e12 * self.bf16_scale),
                   kv_bytes / (C.FLASHMLA_DECODE["memory_gbps"] * 1e9 * self.hbm_scale))

    def attention_prefill_sparse(self, flops: float) -> float:
        """Seconds of FlashMLA's sparse prefill (MQA mode, BF16) of ``flops`` FLOPs: 640 TFLOPS at H800."""
        check_nonnegative("flops", flops)
        return flops / (C.FLASHMLA_SPARSE["prefill_tflops"] * 1e12 * self.bf16_scale)

    def indexer(self, flops: float, nbytes: float) -> float:
        """Seconds of the lightning indexer's logits and top-k: max(FP8 FLOPs / (FP8 peak x the
        share of BF16 peak FlashMLA's sparse prefill reaches), bytes / 3,000 GB/s at H800)."""
        check_nonnegative("flops", flops)
        check_nonnegative("nbytes", nbytes)
        share = C.FLASHMLA_SPARSE["prefill_tflops"] * 1e12 / hardware(H800).peak_flops("bf16")
        return max(flops / (self.hw.peak_flops("fp8") * share),
                   nbytes / (C.FLASHMLA_DECODE["memory_gbps"] * 1e9 * self.hbm_scale))

    # ---- everything else --------------------------------------------------------------
    def other(self, tokens: float, training: bool = False) -> float:
        """Seconds of the non-GEMM, non-attention kernels of one layer's forward for
        ``tokens`` tokens, from train.json's forward chunk (for inference, without the
        kernels only training needs): the latency-bound kernels' fixed time plus the rest
        per token, scaled by HBM bandwidth."""
        check_nonnegative("tokens", tokens)
        if tokens == 0:
            return 0.0
        cal = train_calibration()
        key = "other_fwd_s_per_token" if training else "other_inference_s_per_token"
        return cal["other_fixed_s"] + tokens * cal[key] / self.hbm_scale

    # ---- expert all-to-all ------------------------------------------------------------
    def normal_a2a(self, rdma_bytes: float, nvl_bytes: float, ep: int, combine: bool,
                   intranode: bool = False) -> float:
        """Seconds of a DeepEP normal dispatch (``combine`` False) or combine moving
        ``rdma_bytes`` over the NIC and ``nvl_bytes`` over NVLink on this GPU."""
        b_rdma, b_nvl, b_intra = _normal_bandwidths(combine, ep)
        if intranode:
            return nvl_bytes / (b_intra * self.nvl_scale)
        t_rdma = rdma_bytes / (b_rdma * self.nic_scale)
        t_nvl = nvl_bytes / (b_nvl * self.nvl_scale)
        return max(t_rdma, t_nvl) + min(t_rdma, t_nvl) / NORMAL_CHUNKS

    def low_latency_a2a(self, nbytes: float, ep: int, combine: bool) -> float:
        """Seconds of a DeepEP low-latency dispatch or combine moving ``nbytes``."""
        check_int("ep", ep, 2)
        rows = C.DEEPEP_LOW_LATENCY
        eps = [r.ep for r in rows]
        bws = [(r.combine_gbps if combine else r.dispatch_gbps) * 1e9 for r in rows]
        return nbytes / (_interp_log(ep, eps, bws) * self.nic_scale)


#: Chunks a DeepEP normal kernel pipelines its two legs over (the fill of the faster leg):
#: 4,096 tokens in the benchmark's RDMA chunks of 16 tokens (test_internode.py's Config).
NORMAL_CHUNKS = 4096 // 16


@functools.lru_cache(maxsize=None)
def _normal_bandwidths(combine: bool, ep: int) -> tuple[float, float, float]:
    """(B_rdma at ``ep``, B_nvl of the internode kernels, B_nvl intranode), bytes/s on H800."""
    rows = {r.ep: r for r in C.DEEPEP_NORMAL}
    bw = (lambda r: (r.combine_gbps if combine else r.dispatch_gbps) * 1e9)
    intra = bw(rows[8])
    bench = C.DEEPEP_NORMAL_BENCH
    nodes = 16 // bench["gpus_per_node"]
    s16 = route_stats(bench["experts"], bench["top_k"], nodes, min(nodes, bench["max_nodes"]), 16,
                      bench["gpus_per_node"], bench["tokens"], samples=1)
    b_nvl = bw(rows[16]) * s16.ranks_per_token / s16.nodes_per_token
    rdma_eps = [32, 64]
    b_rdma = _interp_log(ep, rdma_eps, [bw(rows[e]) for e in rdma_eps])
    return b_rdma, b_nvl, intra


@functools.lru_cache(maxsize=None)
def train_calibration() -> dict:
    """What train.json calibrates (from :data:`pdjax.analysis.calibration.TRAIN_PROFILE_RAW`
    and DeepSeek-V3's config): FlashAttention forward and backward efficiency (fraction of
    H800 BF16 peak), the forward "other" kernels' seconds per token per layer, the weight
    gradient GEMMs' efficiency relative to DeepGEMM-roofline forward GEMMs, and the share
    of SMs DeepEP's normal kernels hold."""
    from pdjax import configs
    raw, v3 = C.TRAIN_PROFILE_RAW, configs.deepseek_v3()
    peak = hardware(H800).peak_flops("bf16")
    fa_flops = causal_attention_flops(v3, [(raw["tokens"], 0)])
    fwd_s = sum(raw["fa_fwd_us"]) / len(raw["fa_fwd_us"]) * 1e-6
    return {
        "attention_fwd_eff": fa_flops / fwd_s / peak,
        "attention_bwd_eff": 2.5 * fa_flops / (raw["fa_bwd_us_per_layer"] * 1e-6) / peak,
        "other_fixed_s": raw["other_fwd_fixed_us"] * 1e-6 / raw["layers"],
        "other_fwd_s_per_token": ((raw["other_fwd_us"] - raw["other_fwd_fixed_us"]) * 1e-6
                                  / (raw["layers"] * raw["tokens"])),
        "other_inference_s_per_token": ((raw["other_fwd_us"] - raw["other_fwd_training_only_us"]
                                         - raw["other_fwd_fixed_us"]) * 1e-6 / (raw["layers"] * raw["tokens"])),
        "comm_sm_share": raw["comm_sms"] / raw["num_sms"],
    }


def causal_attention_flops(cfg, chunks) -> float:
    """Forward matmul FLOPs of one layer's prefill attention (the MHA form, as FlashAttention
    runs it) over ``chunks`` [(q new tokens, c cached tokens)]: 2 H (d_qk + d_v) per scored
    (query, key) pair, q c + q (q + 1) / 2 pairs a chunk (causal)."""
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    pairs = sum(causal_pairs(q, c) for q, c in chunks)
    return 2.0 * cfg.num_attention_heads * (d_qk + cfg.v_head_dim) * pairs
