"""The ops of one DeepSeek-style layer on one GPU, timed by :class:`~pdjax.analysis.kernels.KernelModel`:
what a micro-batch of a prefill, a decode or a training chunk runs, per op class.

One layer of one micro-batch splits into the four parts DeepSeek overlaps (attention,
dispatch, MLP, combine). The attention part holds the MLA projections and the router (GEMMs),
the attention core, with DeepSeek-V3.2's sparse attention the lightning indexer's logits and
top-k (op class "indexer", :mod:`pdjax.analysis.sparse_attention`), and the norms, RoPE,
casts and routing ("other"); the MLP part the shared
expert and the routed experts (GEMMs) and their casts and swiglu ("other"); dispatch and
combine are the expert all-to-all. The GEMMs and their shapes are the layer's
(:mod:`pdjax.analysis.layer_gemms`: naive MLA for prefill and training, absorbed for
decode), each timed by :meth:`KernelModel.gemm` in the weight dtype, or BF16 where
DeepSeek's recipe keeps it (``Gemm.fp8`` False: the router, the absorbed per-head products,
the LM head).

With sparse attention (DSA) the attention runs FlashMLA's sparse kernels in MLA's MQA mode
(absorbed projections): decode over min(context, index_topk) FP8 rows per query, prefill over
as many per query. For a prefill micro-batch the model takes the cheaper of that and the
dense masked form (V3's naive MLA over every pair, the indexer's mask applied), as DeepSeek
does: "for short-sequence prefilling, we specially implement a masked MHA mode to simulate
DSA, which can achieve higher efficiency under short-context conditions" (DeepSeek-V3.2-Exp
paper, DeepSeek_V3_2.pdf in deepseek-ai/DeepSeek-V3.2-Exp, section 3, 'Inference Costs'). The
indexer runs in both.

Routed experts run grouped: the GPU's expert slots are the groups, each holding
rows x imbalance / slots rows (rows = tokens x top-k on average; the busiest GPU, which
every GPU waits for at the all-to-all, holds ``imbalance`` times the mean).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pdjax.analysis.kernels import KernelModel, causal_attention_flops
from pdjax.analysis.roofline import attention_flops_per_pair
from pdjax.analysis.kv import kv_row_bytes, serving_kv_layout
from pdjax.analysis.layer_gemms import attention_gemms, dense_mlp_gemms, head_gemms, moe_gemms
from pdjax.analysis.sparse_attention import sparse_work
from pdjax.analysis.routing import RouteStats
from pdjax.model_config import ModelConfig

FP8_TOKEN_BYTES = 1 + 4 / 128       # an FP8 element plus its 1x128 block scale (DeepEP's fp8 factor)


@dataclasses.dataclass(frozen=True)
class Part:
    """Seconds of one part of a layer for one micro-batch, per op class (``indexer``: DSA's
    lightning indexer, 0 without sparse attention)."""

    gemm: float = 0.0
    attention: float = 0.0
    other: float = 0.0
    comm: float = 0.0
    indexer: float = 0.0

    @property
    def compute(self) -> float:
        return self.gemm + self.attention + self.other + self.indexer

    def __add__(self, o: "Part") -> "Part":
        return Part(self.gemm + o.gemm, self.attention + o.attention, self.other + o.other, self.comm + o.comm,
                    self.indexer + o.indexer)

    def scaled(self, f: float) -> "Part":
        return Part(self.gemm * f, self.attention * f, self.other * f, self.comm * f, self.indexer * f)


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """The parts of one layer for one micro-batch: ``attn``, ``shared`` (the shared expert,
    which runs before the dispatched tokens arrive), ``experts`` (routed experts and the
    MLP's other kernels), ``dispatch`` and ``combine`` (``comm`` seconds), or ``dense``
    (the dense MLP of the first layers, no all-to-all)."""

    attn: Part
    shared: Part = Part()
    experts: Part = Part()
    dispatch: Part = Part()
    combine: Part = Part()
    dense: Part = Part()


def gemm_time(km: KernelModel, gemms, rows: dict, weight_dtype: str = "fp8", slots: int = 1) -> float:
    """Seconds of ``gemms`` (:class:`~pdjax.analysis.layer_gemms.Gemm`) one after another,
    M = ``rows[gemm.rows]`` each; the routed experts' rows split over ``slots`` expert slots,
    grouped. In ``weight_dtype``, or BF16 where ``Gemm.fp8`` is False."""
    t = 0.0
    for g in gemms:
        dtype = weight_dtype if g.fp8 else "bf16"
        if g.rows == "routed":
            t += km.gemm(rows["routed"] / slots, g.n, g.k, groups=slots, grouped=True, dtype=dtype)
        else:
            t += km.gemm(rows[g.rows], g.n, g.k, groups=g.groups, dtype=dtype)
    return t


def attention_part(km: KernelModel, cfg: ModelConfig, *, chunks: Optional[Sequence] = None,
                   decode: Optional[Sequence] = None, weight_dtype: str = "fp8", moe: bool = True,
                   training: bool = False) -> Part:
    """The attention part of one layer. Prefill: ``chunks`` [(q new, c cached)], the naive
    MLA form (every latent expanded by kv_b, FlashAttention over them). Decode: ``decode``
    [(q tokens, kv length)] per request, the absorbed form (FlashMLA over the latent cache).
    With sparse attention: :func:`sparse_attention_part`."""
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    reqs = chunks if chunks is not None else decode
    if cfg.sparse_attention:
        return sparse_attention_part(km, cfg, reqs, prefill=chunks is not None, weight_dtype=weight_dtype,
                                     moe=moe, training=training)
    T = sum(q for q, _ in reqs)
    gemms = attention_gemms(cfg, "naive" if chunks is not None else "absorbed")
    gemms += tuple(x for x in moe_gemms(cfg) if x.block == "router") if moe else ()
    if chunks is not None:
        g = gemm_time(km, gemms, {"token": T, "attended": sum(q + c for q, c in chunks)}, weight_dtype)
        core = km.attention_prefill(causal_attention_flops(cfg, chunks))
    else:
        g = gemm_time(km, gemms, {"token": T}, weight_dtype)
        flops = sum(float(attention_flops_per_pair(cfg)) * q * (kv + q) for q, kv in decode)
        kv_bytes = sum(kv + q for q, kv in decode) * (C + R) * 2
        core = km.attention_decode(flops, kv_bytes)
    return Part(gemm=g, attention=core, other=km.other(T, training) / 2)


def sparse_attention_part(km: KernelModel, cfg: ModelConfig, reqs, *, prefill: bool, weight_dtype: str = "fp8",
                          moe: bool = True, training: bool = False) -> Part:
    """The attention part of one layer with DeepSeek sparse attention, ``reqs`` [(q, c)] (see the
    module docstring): the indexer on DeepSeek's FP8 key rows; decode: FlashMLA's sparse
    decoding over the selected FP8 rows, absorbed projections; prefill: the cheaper of
    FlashMLA's sparse prefill (absorbed) and the dense masked form (naive, FlashAttention)."""
    T = sum(q for q, _ in reqs)
    router = tuple(x for x in moe_gemms(cfg) if x.block == "router") if moe else ()
    work = sparse_work(cfg, reqs, kv_row_bytes(cfg, *serving_kv_layout(cfg)))
    indexer = km.indexer(work.indexer_flops, work.indexer_bytes)
    g = gemm_time(km, attention_gemms(cfg, "absorbed") + router, {"token": T}, weight_dtype)
    if not prefill:
        core = km.attention_decode_sparse(work.attention_flops, work.attention_bytes, cfg.index_topk)
    else:
        core = km.attention_prefill_sparse(work.attention_flops)
        rows = {"token": T, "attended": sum(q + c for q, c in reqs)}
        g_dense = gemm_time(km, attention_gemms(cfg, "naive") + router, rows, weight_dtype)
        core_dense = km.attention_prefill(causal_attention_flops(cfg, reqs))
        if g_dense + core_dense < g + core:
            g, core = g_dense, core_dense
    return Part(gemm=g, attention=core, other=km.other(T, training) / 2, indexer=indexer)


def moe_parts(km: KernelModel, cfg: ModelConfig, tokens: int, *, ep: int, slots: int, imbalance: float,
              weight_dtype: str = "fp8", training: bool = False) -> tuple[Part, Part]:
    """(shared expert, routed experts) of one MoE layer for ``tokens`` tokens on this GPU."""
    gemms = moe_gemms(cfg)
    rows = {"token": tokens, "routed": tokens * cfg.num_experts_per_tok * imbalance}
    shared = gemm_time(km, [g for g in gemms if g.block == "shared"], rows, weight_dtype)
    routed = gemm_time(km, [g for g in gemms if g.block == "routed"], rows, weight_dtype, slots=slots // ep)
    return Part(gemm=shared), Part(gemm=routed, other=km.other(tokens, training) / 2)


def dense_part(km: KernelModel, cfg: ModelConfig, tokens: int, weight_dtype: str = "fp8") -> Part:
    """The dense MLP of one of the first ``first_k_dense_replace`` layers."""
    g = gemm_time(km, dense_mlp_gemms(cfg), {"token": tokens}, weight_dtype)
    return Part(gemm=g, other=km.other(tokens) / 2)


def a2a_parts(km: KernelModel, cfg: ModelConfig, tokens: int, *, ep: int, stats: RouteStats, kernels: str,
              intranode: bool, imbalance: float) -> tuple[Part, Part]:
    """(dispatch, combine) of ``tokens`` tokens on this GPU. ``kernels``: "normal" (DeepEP's
    high-throughput kernels: FP8 out, BF16 back, once per node over RDMA and once per GPU
    over NVLink) or "low_latency" (every top-k copy, straight to its GPU). The busiest
    receiver, ``imbalance`` times the mean, sets the time."""
    hidden = cfg.hidden_size
    if kernels == "low_latency":
        copies = tokens * cfg.num_experts_per_tok * imbalance
        d_bytes, c_bytes = copies * (hidden * FP8_TOKEN_BYTES + 16), copies * hidden * 2
        if intranode:                          # one NVLink domain (e.g. NVL72): NVLink at its measured speed
            return (Part(comm=km.normal_a2a(0.0, d_bytes, ep, False, intranode=True)),
                    Part(comm=km.normal_a2a(0.0, c_bytes, ep, True, intranode=True)))
        d = km.low_latency_a2a(d_bytes, ep, combine=False)
        c = km.low_latency_a2a(c_bytes, ep, combine=True)
        return Part(comm=d), Part(comm=c)
    out = []
    for per_elem, combine in ((FP8_TOKEN_BYTES, False), (2, True)):
        rdma = tokens * stats.nodes_per_token * hidden * per_elem
        nvl = tokens * stats.ranks_per_token * hidden * per_elem * imbalance
        out.append(Part(comm=km.normal_a2a(rdma, nvl, ep, combine, intranode=intranode)))
    return out[0], out[1]


def lm_head_part(km: KernelModel, cfg: ModelConfig, tokens: int) -> Part:
    """Final norm and the BF16 LM head for ``tokens`` sampled positions."""
    return Part(gemm=gemm_time(km, head_gemms(cfg), {"token": tokens}))
