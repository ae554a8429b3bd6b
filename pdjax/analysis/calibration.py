"""What the op-level cost model is calibrated on: DeepSeek's own published measurements,
each with its repository, file and table. Nothing here was measured by anyone else; the
independent measurements the model is held against live in
:mod:`pdjax.analysis.validation_set`, which no module of the model imports.

All kernel figures are H800 SXM5 (132 SMs, HBM3 3.35 TB/s, NVLink ~160 GB/s per direction,
one 400 Gb/s ConnectX-7 NIC per GPU), as their sources state. How each one enters the
model (and how it is carried to other hardware) is in :mod:`pdjax.analysis.kernels`.

Units: TFLOPS = 1e12 FLOP/s, GB/s = 1e9 bytes/s, us = microseconds, ms = milliseconds.
"""

from __future__ import annotations

import dataclasses

_DEEPGEMM = ("deepseek-ai/DeepGEMM README.md at 2e7e580 (2025-04-11, the last README with the "
             "performance tables; `git show 37aa127^:README.md`), section 'Performance', H800 SXM5, "
             "NVCC 12.8")
_DEEPGEMM_FEB = ("deepseek-ai/DeepGEMM README.md at a6d97a1 (2025-02-25, the first release), section "
                 "'Performance', H800 SXM5, NVCC 12.8; 'Speedup' is over DeepSeek's internal CUTLASS 3.6-based "
                 "kernels")
_FLASHMLA = ("deepseek-ai/FlashMLA README.md at 9241ae3, section 'Performance': 'The dense MLA decoding "
             "kernel achieves up to 3000 GB/s in memory-bound configuration and 660 TFLOPS in "
             "computation-bound configuration on H800 SXM5 with CUDA 12.8'")
_DEEPEP = ("deepseek-ai/DeepEP docs/legacy.md at dd758ca, section 'Performance' (DeepEP V1; H800, "
           "~160 GB/s NVLink, CX7 400 Gb/s RDMA ~50 GB/s)")
_DEEPEP_TEST = ("deepseek-ai/DeepEP tests/legacy/test_internode.py and test_low_latency.py at dd758ca "
                "(how the tables' bytes are counted and how tokens are routed)")
_SGLANG_PROFILE = ("lm-sys.github.io blog/2025-05-05-large-scale-ep.md, 'Profile Results' tables, "
                   "column 'DeepSeek Profile' (throughput SGLang derived from deepseek-ai/profile-data)")


@dataclasses.dataclass(frozen=True)
class GemmPoint:
    """One DeepGEMM measurement: ``groups`` x (``m`` rows per group) times an N x K weight,
    FP8 in, BF16 out, at ``tflops`` and ``gbps`` as printed; ``speedup`` is the table's
    speedup over DeepSeek's internal CUTLASS-based kernels (so those ran at tflops / speedup)."""

    layout: str          # "normal", "contiguous" (grouped, prefill/training) or "masked" (grouped, decode)
    groups: int
    m: int
    n: int
    k: int
    tflops: float
    gbps: float
    speedup: float


#: DeepGEMM FP8 GEMMs on H800 that its April 2025 update left as they were in February
#: (the M = 64 and 128 normal rows and the masked grouped rows, identical in both READMEs).
_DEEPGEMM_UNCHANGED = (
    GemmPoint("normal", 1, 64, 2112, 7168, 206, 1688, 2.7),
    GemmPoint("normal", 1, 64, 24576, 1536, 289, 2455, 1.7),
    GemmPoint("normal", 1, 64, 32768, 512, 219, 2143, 1.8),
    GemmPoint("normal", 1, 64, 7168, 16384, 336, 2668, 1.4),
    GemmPoint("normal", 1, 64, 4096, 7168, 287, 2320, 1.4),
    GemmPoint("normal", 1, 64, 7168, 2048, 295, 2470, 1.7),
    GemmPoint("normal", 1, 128, 2112, 7168, 352, 1509, 2.4),
    GemmPoint("normal", 1, 128, 24576, 1536, 535, 2448, 1.6),
    GemmPoint("normal", 1, 128, 32768, 512, 358, 2103, 1.5),
    GemmPoint("normal", 1, 128, 7168, 16384, 645, 2604, 1.4),
    GemmPoint("normal", 1, 128, 4096, 7168, 533, 2221, 2.0),
    GemmPoint("normal", 1, 128, 7168, 2048, 510, 2277, 1.7),
    GemmPoint("masked", 1, 1024, 4096, 7168, 1233, 924, 1.2),
    GemmPoint("masked", 1, 1024, 7168, 2048, 925, 968, 1.2),
    GemmPoint("masked", 2, 512, 4096, 7168, 1040, 1288, 1.2),
    GemmPoint("masked", 2, 512, 7168, 2048, 916, 1405, 1.2),
    GemmPoint("masked", 4, 256, 4096, 7168, 932, 2064, 1.1),
    GemmPoint("masked", 4, 256, 7168, 2048, 815, 2047, 1.2),
)
#: DeepGEMM FP8 GEMMs on H800, April 2025 (normal, grouped contiguous, grouped masked).
DEEPGEMM_2025_04 = _DEEPGEMM_UNCHANGED + (
    GemmPoint("normal", 1, 4096, 2112, 7168, 1127, 562, 1.2),
    GemmPoint("normal", 1, 4096, 24576, 1536, 1212, 962, 1.2),
    GemmPoint("normal", 1, 4096, 32768, 512, 775, 1620, 1.2),
    GemmPoint("normal", 1, 4096, 7168, 16384, 1520, 384, 1.4),
    GemmPoint("normal", 1, 4096, 4096, 7168, 1410, 541, 1.3),
    GemmPoint("normal", 1, 4096, 7168, 2048, 1168, 794, 1.2),
    GemmPoint("contiguous", 4, 8192, 4096, 7168, 1346, 434, 1.3),
    GemmPoint("contiguous", 4, 8192, 7168, 2048, 1214, 752, 1.3),
    GemmPoint("contiguous", 8, 4096, 4096, 7168, 1346, 516, 1.3),
    GemmPoint("contiguous", 8, 4096, 7168, 2048, 1214, 826, 1.2),
)
#: DeepGEMM's first release, February 2025 (same shapes; its speedups give DeepSeek's
#: internal kernels of the time, which its February 2025 profiles ran).
DEEPGEMM_2025_02 = _DEEPGEMM_UNCHANGED + (
    GemmPoint("normal", 1, 4096, 2112, 7168, 1058, 527, 1.1),
    GemmPoint("normal", 1, 4096, 24576, 1536, 990, 786, 1.0),
    GemmPoint("normal", 1, 4096, 32768, 512, 590, 1232, 1.0),
    GemmPoint("normal", 1, 4096, 7168, 16384, 1358, 343, 1.2),
    GemmPoint("normal", 1, 4096, 4096, 7168, 1304, 500, 1.1),
    GemmPoint("normal", 1, 4096, 7168, 2048, 1025, 697, 1.1),
    GemmPoint("contiguous", 4, 8192, 4096, 7168, 1297, 418, 1.2),
    GemmPoint("contiguous", 4, 8192, 7168, 2048, 1099, 681, 1.2),
    GemmPoint("contiguous", 8, 4096, 4096, 7168, 1288, 494, 1.2),
    GemmPoint("contiguous", 8, 4096, 7168, 2048, 1093, 743, 1.1),
)
#: The GEMM kernel sets a deployment can name: (table, whether to divide by the speedup, source).
GEMM_KERNELS = {
    "deepgemm-2025-04": (DEEPGEMM_2025_04, False, _DEEPGEMM),
    "deepgemm-2025-02": (DEEPGEMM_2025_02, False, _DEEPGEMM_FEB),
    "deepseek-internal-2025-02": (DEEPGEMM_2025_02, True, _DEEPGEMM_FEB + " (TFLOPS / speedup)"),
}

#: FlashMLA dense decoding on H800: the two ceilings its README prints (two points, not
#: curves: the model uses a roofline through them).
FLASHMLA_DECODE = {"memory_gbps": 3000.0, "compute_tflops": 660.0}
FLASHMLA_SOURCE = _FLASHMLA

#: FlashMLA's token-level sparse kernels (DeepSeek-V3.2's sparse attention, DSA) on H800, as
#: DeepSeek printed them (MQA mode: d_qk 576, d_v 512, so 2 x 128 x (576 + 512) FLOPs per
#: (query token, selected key) for V3.2's 128 heads; sources below):
#:
#: * ``decode_tflops``: {topk: TFLOPS} of the sparse decoding kernel (FP8 KV cache dequantized
#:   to BF16, BF16 MMAs), compute-bound: 410 at "batch_size=128, num_heads=128, s_q=2,
#:   topk=2048", 460 "if we set topk to a larger value, such as 32768". No memory-bound figure
#:   is printed (the kernel is dequantization-bound, and at 2 x 128 x 1088 FLOPs per 656-byte
#:   row compute-bound on H800): the model reads its rows at the dense kernel's 3,000 GB/s.
#: * ``prefill_tflops``: the sparse prefill kernel, "up to 640 TFlops in forward computation".
#: * ``dense_equal_seq_len``: the deep-dive's check, not a calibration: the sparse decode in
#:   the 410-TFLOPS configuration takes about as long as "the dense decoding kernel when the
#:   sequence length is around 3000" (tests/analysis/test_dsa_costs.py holds the model to it).
FLASHMLA_SPARSE = {"decode_tflops": {2048: 410.0, 32768: 460.0}, "prefill_tflops": 640.0,
                   "dense_equal_seq_len": 3000}
FLASHMLA_SPARSE_SOURCE = (
    "deepseek-ai/FlashMLA README.md at 9241ae3, 'Performance': 'The token-level sparse MLA decoding kernel "
    "(which uses an FP8 KV cache while performing the matrix multiplication in bfloat16) achieves 410 TFLOPS in "
    "compute-bound configuration on H800 SXM5 with CUDA 12.8'; 'MLA prefill (Sparse) ... achieves up to 640 "
    "TFlops in forward computation on H800 SXM5'; docs/20250929-hopper-fp8-sparse-deep-dive.md, 'Performance': "
    "'410 TFLOPS in a compute-bound configuration (batch_size=128, num_heads=128, s_q=2, topk=2048) on H800 "
    "SXM5', 'If we set topk to a larger value, such as 32768, this kernel can achieve up to 460 TFLOPS', "
    "'comparable to that of the dense decoding kernel when the sequence length is around 3000'")
#: DeepSeek publishes no timing of the lightning indexer's kernels (DeepGEMM's
#: ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits``, README section 'V3.2 MQA kernels for the
#: indexer', give shapes, not speeds). What the model takes from them is their traffic, as
#: DeepGEMM's own benchmark counts it (tests/test_attention.py at 54e2261): FLOPs
#: 2 x keys x queries x heads x head_dim, bytes "kv_sum_lens * (head_dim + 4)" (each key and its
#: float32 scale read once per sequence) + "sum_lens * next_n * logits_dtype.itemsize" (FP32
#: logits written per (query, key)).
INDEXER_SOURCE = ("deepseek-ai/DeepGEMM README.md and tests/test_attention.py at 54e2261; "
                  "deepseek-ai/DeepSeek-V3.2-Exp inference/kernel.py fp8_index at 3b99a53")


@dataclasses.dataclass(frozen=True)
class DeepEPNormal:
    """DeepEP's normal (high-throughput) kernels at ``ep`` ranks: the bottleneck bandwidth
    of dispatch (FP8) and combine (BF16) in GB/s on ``link`` ("nvlink" intranode, "rdma"
    internode). Benchmark: 4,096 tokens per rank, hidden 7,168, top-8 of 256 experts,
    routed to at most min(nodes, 4) nodes, 24 SMs."""

    ep: int
    link: str
    dispatch_gbps: float
    combine_gbps: float


DEEPEP_NORMAL = (
    DeepEPNormal(8, "nvlink", 153, 158),
    DeepEPNormal(16, "rdma", 43, 43),
    DeepEPNormal(32, "rdma", 58, 57),
    DeepEPNormal(64, "rdma", 51, 50),
)
#: The normal-kernel benchmark's set-up (tests/legacy/test_internode.py defaults).
DEEPEP_NORMAL_BENCH = {"tokens": 4096, "hidden": 7168, "top_k": 8, "experts": 256,
                       "max_nodes": 4, "sms": 24, "gpus_per_node": 8}


@dataclasses.dataclass(frozen=True)
class DeepEPLowLatency:
    """DeepEP's low-latency kernels at ``ep`` ranks: dispatch (FP8) and combine (BF16)
    kernel time (us) and the bandwidth it implies (GB/s, all top-k copies counted).
    Benchmark: 128 tokens per rank, hidden 7,168, top-8, pure RDMA."""

    ep: int
    dispatch_us: float
    dispatch_gbps: float
    combine_us: float
    combine_gbps: float


DEEPEP_LOW_LATENCY = (
    DeepEPLowLatency(8, 77, 98, 114, 127),
    DeepEPLowLatency(16, 118, 63, 195, 74),
    DeepEPLowLatency(32, 155, 48, 273, 53),
    DeepEPLowLatency(64, 173, 43, 314, 46),
    DeepEPLowLatency(128, 192, 39, 369, 39),
    DeepEPLowLatency(256, 194, 39, 360, 40),
)
DEEPEP_LOW_LATENCY_BENCH = {"tokens": 128, "hidden": 7168, "top_k": 8}
DEEPEP_SOURCE = _DEEPEP
DEEPEP_TEST_SOURCE = _DEEPEP_TEST
#: H800 figures the DeepEP tables were measured against (its own words).
DEEPEP_H800_NVLINK_GBPS = 160.0      # "H800 (~160 GB/s NVLink maximum bandwidth)"
DEEPEP_H800_RDMA_GBPS = 50.0         # "CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)"


@dataclasses.dataclass(frozen=True)
class ProfileThroughput:
    """A throughput DeepSeek's own profile implies: tokens per second per 8-GPU node."""

    role: str
    tokens_per_s_per_node: float
    hardware: str
    ep: int
    nodes: int
    batch_per_gpu: int          # tokens (prefill) or requests (decode)
    input_len: int              # prompt length (prefill) / KV length (decode)
    overlap: str
    note: str
    source: str = _SGLANG_PROFILE


#: DeepSeek's profile throughputs, in sample: they may calibrate overlap terms, and are
#: reproduced as a consistency check (docs/validation.md).
DEEPSEEK_PROFILE = (
    ProfileThroughput("prefill", 62_713, "h800", 32, 4, 16_384, 4_096, "tbo",
                      "deepseek-ai/profile-data README: EP32, TP1, prompt 4K, 16K tokens per GPU, two "
                      "micro-batches; 'absolutely balanced MoE routing'"),
    ProfileThroughput("decode", 18_598, "h800", 128, 16, 128, 4_096, "tbo",
                      "deepseek-ai/profile-data README: EP128, TP1, prompt 4K, 128 requests per GPU, two "
                      "micro-batches; DeepSeek serves with MTP (one draft token); the blog compares it "
                      "with its own simulated MTP at 60 % acceptance"),
)


#: What deepseek-ai/profile-data train.json shows (derived with
#: :func:`pdjax.analysis.profile.read_profile`; `scripts/derive_train_profile.py train.json`
#: prints every figure below; the trace itself
#: carries no licence and is not in this repository). One DualPipe forward & backward chunk
#: pair, 4 MoE layers of DeepSeek-V3 each way, EP64, 4K sequence, H800. Tokens per micro-batch:
#: 4,096 (the FlashAttention grid is 32 tiles of 128 queries x 128 heads; the per-token FP8
#: casts launch 4,096 rows), one sequence.
TRAIN_PROFILE_SOURCE = ("deepseek-ai/profile-data train.json at 4496024 (captured 2025-02-25), kernels "
                        "classified by pdjax.analysis.profile.read_profile")
TRAIN_PROFILE_RAW = {
    "layers": 4,                     # MoE layers per chunk
    "tokens": 4096,                  # tokens per micro-batch (one 4K sequence)
    "makespan_us": 129_012,          # first kernel start to last kernel end
    "class_us": {"gemm": 75_057, "attention": 21_965, "dispatch": 48_757, "combine": 64_683, "other": 33_607},
    "fa_fwd_us": (1248, 1199, 1280, 1221),      # FlashAttention forward kernel, one per layer
    "fa_bwd_us_per_layer": 4254,     # FlashAttention backward with its pre- and post-processing
    "other_fwd_us": 10_888,          # "other" kernels launched in attn(F) and mlp(F), 4 layers
    "other_fwd_kernels": 311,        # their count
    # of which only training needs them (4 layers): the FP8 copies kept for the backward
    # (per_token_cast_to_fp8_with_fp8_special_fmt 742), the transposes for weight gradients
    # (batched_transpose 556, grouped_gemm utils::transpose 236) and the auxiliary-loss
    # statistics (aux_fi_impl, its reductions and the noise sampling, 163)
    "other_fwd_training_only_us": 742 + 556 + 236 + 163,
    # the rest that take <= 5 us at 4,096 tokens (113 kernels): too short to stream one
    # activation pass (4,096 x 7,168 BF16 = 58.7 MB is 17.5 us of HBM), so latency-bound:
    # their time does not shrink with fewer tokens
    "other_fwd_fixed_us": 259,
    "wgrad_us": 32_756,              # GEMMs launched in mlp(W) and attn(W): the weight gradients
    "num_sms": 132,                  # deviceProperties.numSms
    "comm_sms": 20,                  # grid of every DeepEP dispatch/combine kernel
}
