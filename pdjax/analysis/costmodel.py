"""Roofline op cost model: step times of prefill and decode from (config, hardware).

Every op of a decoder layer costs ``max(FLOPs / (peak * eff), bytes / (HBM bw * eff))``
plus, for communication, ``link bytes / (link bw * eff)``; a step is the sum over ops and
layers (no overlap between ops is assumed; dual-batch overlap would hide the all-to-all).
Parameter counts come from :func:`~pdjax.analysis.param_counts`, KV bytes from
:func:`~pdjax.analysis.kv_bytes_per_token`, the handoff from
:func:`~pdjax.analysis.kv_handoff_time`, peaks and bandwidths from the
:class:`~pdjax.analysis.HardwareSpec`.

Ops (per layer unless noted; T = tokens in the step, p = ``dtype_bytes``):

* ``attention``: MLA. Prefill runs the *naive* form: per request of q new tokens over c
  cached ones, the latents of all c + q tokens are up-projected to per-head K/V
  (``wkv_b``), and q * c + q (q + 1) / 2 causal (query, key) pairs are scored. Decode runs
  the *absorbed* form: one (C + R)-wide score and one C-wide value dot per (token, cached
  token, head); the cache is read, never expanded. With DeepSeek-V3.2's sparse attention
  (:mod:`pdjax.analysis.sparse_attention`) both run MLA's MQA mode over the selected keys,
  min(context, index_topk) a query (a decode query gathers its rows; a prefill reads the
  prefix once, neighbouring queries sharing their selections on chip), and the lightning
  indexer scores every pair (its FLOPs at the attention efficiency, its keys and FP32
  logits in HBM bytes). The masked dense form DeepSeek runs for short prompts is not modelled.
* ``dense_mlp``: SwiGLU of the first dense layers.
* ``moe_experts``: router + shared experts + routed top-k. Weight bytes count only the
  experts a batch touches: with uniform routing, T tokens with top-k of E touch
  E (1 - (1 - k/E)^T) distinct experts on average (:func:`expected_distinct_experts`).
* ``all_to_all``: EP dispatch + combine, when ``ep_size > 1``.
* ``lm_head``: final norm + logits of the sampled positions (one per request), plus the
  per-layer norm weights.

Bytes are HBM traffic: weights, KV cache reads and writes, the expanded K/V of naive MLA
(written and read once), and each op's input and output activations; other intermediate
activations are assumed to stay on chip (fused kernels). FLOPs count multiply-adds as 2.
An *instance* is ``ep_size`` accelerators: attention and dense layers data-parallel over
them (weights replicated, tokens and KV split evenly), routed experts split E / ep per
accelerator. Perfect balance is assumed; :class:`Efficiency` is where measured shortfalls
go (all factors default to 1.0, the ideal roofline).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pdjax.analysis.afd_bounds import afd_exchange_bytes
from pdjax.analysis.hardware import HardwareLike, hardware
from pdjax.analysis.kv import kv_bytes_per_token as _kv_bytes_per_token, kv_handoff_time, kv_row_bytes
from pdjax.analysis.layer_gemms import attention_gemms, weight_elements
from pdjax.analysis.sparse_attention import sparse_work
from pdjax.param_counts import param_counts
from pdjax.analysis.roofline import attention_flops_per_pair, attention_flops_per_token, causal_pairs
from pdjax.arguments import check_fraction, check_int, check_nonnegative, check_positive
from pdjax.model_config import ModelConfig

A2A_LINKS = ("auto", "scale_up", "scale_out")
GPUS_PER_NODE = 8   # "auto" all-to-all uses the scale-up link up to this EP degree


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the roofline each kind of work achieves; 1.0 everywhere (the default) is
    the ideal roofline, a lower bound on step time.

    * ``matmul``: fraction of peak FLOP/s reached by weight GEMMs (projections, MLP, experts);
    * ``attention``: fraction of peak FLOP/s reached by the attention core (scores, PV);
    * ``hbm``: fraction of HBM bandwidth reached;
    * ``network``: fraction of link bandwidth reached (all-to-all, KV transfer);
    * ``step_overhead_s``: fixed seconds added to every non-empty step (launch, scheduling).
    """

    matmul: float = 1.0
    attention: float = 1.0
    hbm: float = 1.0
    network: float = 1.0
    step_overhead_s: float = 0.0

    def __post_init__(self):
        for name in ("matmul", "attention", "hbm", "network"):
            check_fraction(f"Efficiency.{name}", getattr(self, name))
        check_nonnegative("Efficiency.step_overhead_s", self.step_overhead_s)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """Cost of one op on one accelerator of the instance, per layer it occurs in.

    ``flops`` (FLOP), ``hbm_bytes`` and ``link_bytes`` (bytes) are per layer and per
    accelerator; ``compute_s``, ``memory_s``, ``network_s`` the matching seconds;
    ``layers`` how many layers run the op."""

    name: str
    layers: int
    flops: float
    hbm_bytes: float
    link_bytes: float
    compute_s: float
    memory_s: float
    network_s: float

    @property
    def time_s(self) -> float:
        """Seconds per layer: max(compute, memory) + network."""
        return max(self.compute_s, self.memory_s) + self.network_s

    @property
    def total_s(self) -> float:
        return self.time_s * self.layers

    @property
    def bound(self) -> str:
        """"network", "compute" or "memory": what dominates this op's time."""
        if self.network_s > max(self.compute_s, self.memory_s):
            return "network"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(time_s=self.time_s, total_s=self.total_s, bound=self.bound)
        return d


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Mean number of distinct experts T tokens touch when each picks ``top_k`` of
    ``num_experts`` uniformly: E (1 - (1 - k/E)^T); k at T = 1, -> E as T grows."""
    check_int("num_experts", num_experts)
    check_int("top_k", top_k)
    check_nonnegative("num_tokens", num_tokens)
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


class RooflineCostModel:
    """Step times of one serving instance from the roofline of each op.

    ``cfg``: the model; ``hw``: a HardwareSpec or preset name; ``dtype_bytes``: bytes per
    weight, activation and cached element (2 = bf16 peak, 1 = fp8 peak); ``ep_size``:
    accelerators in the instance (expert-parallel degree); ``efficiency``: see
    :class:`Efficiency`; ``a2a_link``: "scale_up", "scale_out" or "auto" (scale-up up to
    8-way EP, i.e. within a node); ``a2a_bw``: override of the all-to-all bandwidth, bytes/s.
    """

    def __init__(self, cfg: ModelConfig, hw: HardwareLike, *, dtype_bytes: int = 2,
                 ep_size: int = 1, efficiency: Optional[Efficiency] = None,
                 a2a_link: str = "auto", a2a_bw: Optional[float] = None):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.hw = hardware(hw)
        if dtype_bytes not in (1, 2) or isinstance(dtype_bytes, bool):
            raise ValueError(f"dtype_bytes must be 1 (fp8) or 2 (bf16), got {dtype_bytes!r}")
        self.dtype_bytes = int(dtype_bytes)
        self.ep_size = check_int("ep_size", ep_size)
        self.efficiency = Efficiency() if efficiency is None else efficiency
        if not isinstance(self.efficiency, Efficiency):
            raise TypeError(f"efficiency must be an Efficiency, got {type(efficiency).__name__}")
        if a2a_link not in A2A_LINKS:
            raise ValueError(f"a2a_link must be one of {A2A_LINKS}, got {a2a_link!r}")
        self.a2a_link = a2a_link
        self.a2a_bw = None if a2a_bw is None else check_positive("a2a_bw", a2a_bw)
        self.peak_flops = self.hw.peak_flops("fp8" if self.dtype_bytes == 1 else "bf16")
        self.hbm_bw = self.hw.require("hbm_bw", "the roofline cost model")

        counts = param_counts(cfg)
        L = cfg.num_hidden_layers
        self.num_moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
        self.num_dense_layers = L - self.num_moe_layers
        # Per-layer parameter counts (elements), derived from param_counts (kv_b: from layer_gemms).
        self._attn = counts.attention // L
        self._wkv_b = weight_elements(cfg, [g for g in attention_gemms(cfg, "naive") if g.name == "kv_b"])
        self._mlp = counts.dense_mlp // self.num_dense_layers if self.num_dense_layers else 0
        n_moe = self.num_moe_layers
        self._expert = counts.routed_experts // (n_moe * cfg.n_routed_experts) if n_moe else 0
        self._shared = counts.shared_experts // n_moe if n_moe else 0
        self._router = counts.router // n_moe if n_moe else 0
        self._head = (counts.lm_head or counts.embedding) + counts.norms
        self._counts = counts
        self._latent_bytes = self.kv_bytes_per_token() / L       # one token, one layer

    # ---- public API used by the serving simulator -----------------------------------------

    def afd_exchange_bytes(self, num_ffn: int) -> float:
        """One-way attention<->FFN bytes per token per layer (activations in this dtype)."""
        return afd_exchange_bytes(self.cfg.hidden_size, self.cfg.num_experts_per_tok, num_ffn, self.dtype_bytes)

    def kv_bytes_per_token(self) -> int:
        """MLA cache bytes per token over all layers at this dtype."""
        return _kv_bytes_per_token(self.cfg, self.dtype_bytes)

    def prefill_step_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of one batched prefill step; ``chunks`` = [(q new tokens, c cached prefix)]
        per request. An empty step takes 0 s."""
        return self._step_time(self.op_costs(chunks=chunks))

    def decode_step_time(self, kv_lens: Sequence[int]) -> float:
        """Seconds of one decode step of ``len(kv_lens)`` requests, one new token each;
        ``kv_lens[i]`` tokens already cached (the new token attends to kv_len + 1)."""
        return self._step_time(self.op_costs(kv_lens=kv_lens))

    def kv_transfer_time(self, num_tokens: int, link_bw: float) -> float:
        """Seconds to move ``num_tokens`` tokens of KV over a ``link_bw`` bytes/s link
        (times the network efficiency): tokens * kv_bytes_per_token / bw."""
        num_tokens = check_int("num_tokens", num_tokens, 0)
        check_positive("link_bw", link_bw)
        if num_tokens == 0:
            return 0.0
        return kv_handoff_time(num_tokens, self.kv_bytes_per_token(),
                               link_bw * self.efficiency.network)

    def decode_attention_time(self, kv_lens: Sequence[int]) -> float:
        """AF disaggregation, attention side of a decode step: the attention op of every
        layer, the LM head and the step overhead (with :meth:`decode_ffn_time` of the same
        tokens it sums to :meth:`decode_step_time`; the A<->F exchange is not included)."""
        ops = self.op_costs(kv_lens=kv_lens)
        return self._step_time({k: ops[k] for k in ("attention", "lm_head") if k in ops})

    def decode_ffn_time(self, num_tokens: int) -> float:
        """AF disaggregation, FFN side: dense MLPs, MoE experts and (ep > 1) the expert
        all-to-all for ``num_tokens`` decode tokens."""
        T = check_int("num_tokens", num_tokens, 0)
        if T == 0:
            return 0.0
        ops = [self._dense_mlp(T)] if self.num_dense_layers else []
        if self.num_moe_layers:
            ops += [self._moe(T)] + ([self._all_to_all(T)] if self.ep_size > 1 else [])
        return sum(op.total_s for op in ops)

    def op_costs(self, chunks: Optional[Sequence[tuple[int, int]]] = None, *,
                 kv_lens: Optional[Sequence[int]] = None) -> dict:
        """Per-op breakdown {name: :class:`OpCost`} of a prefill step (``chunks``) or a
        decode step (``kv_lens``); exactly one of the two. Ops a model lacks are absent."""
        if (chunks is None) == (kv_lens is None):
            raise ValueError("op_costs needs exactly one of chunks= (prefill) or kv_lens= (decode)")
        if chunks is not None:
            reqs = self._check_chunks(chunks)
            decode = False
        else:
            if isinstance(kv_lens, (str, bytes)) or not hasattr(kv_lens, "__iter__"):
                raise ValueError(f"kv_lens must be a list of ints, got {kv_lens!r}")
            reqs = [(1, check_int(f"kv_lens[{i}]", s, 0)) for i, s in enumerate(kv_lens)]
            decode = True
        if not reqs:
            return {}
        T = sum(q for q, _ in reqs)
        ops = [self._attention(reqs, T, decode)]
        if self.num_dense_layers:
            ops.append(self._dense_mlp(T))
        if self.num_moe_layers:
            ops.append(self._moe(T))
            if self.ep_size > 1:
                ops.append(self._all_to_all(T))
        ops.append(self._lm_head(len(reqs)))
        return {op.name: op for op in ops}

    def step_time(self, op_costs: dict) -> float:
        """Sum of an :meth:`op_costs` breakdown plus the per-step overhead."""
        return self._step_time(op_costs)

    def touched_weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` tokens reads on the whole instance (all ep
        ranks together, counting replicated weights once). At one token this is the active
        parameter count times ``dtype_bytes``."""
        T = check_int("num_tokens", num_tokens, 1)
        E, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        experts = expected_distinct_experts(E, k, T) if self.num_moe_layers else 0.0
        elements = (self._counts.attention + self._counts.dense_mlp + self._counts.shared_experts
                    + self._counts.router + self._head
                    + self.num_moe_layers * experts * self._expert)
        return elements * self.dtype_bytes

    # ---- ops ---------------------------------------------------------------------------

    def _op(self, name, layers, flops_matmul, flops_attn, bytes_replicated, bytes_split,
            link_bytes=0.0, link_bw=None) -> OpCost:
        """Per-accelerator cost: FLOPs and split bytes divide by ep, replicated bytes don't."""
        eff, ep = self.efficiency, self.ep_size
        flops = (flops_matmul + flops_attn) / ep
        compute = (flops_matmul / (self.peak_flops * eff.matmul)
                   + flops_attn / (self.peak_flops * eff.attention)) / ep
        hbm = bytes_replicated + bytes_split / ep
        network = link_bytes / (link_bw * eff.network) if link_bytes else 0.0
        return OpCost(name, layers, flops, hbm, link_bytes, compute,
                      hbm / (self.hbm_bw * eff.hbm), network)

    def _attention(self, reqs, T, decode: bool) -> OpCost:
        cfg, p = self.cfg, self.dtype_bytes
        H, R = cfg.num_attention_heads, cfg.qk_rope_head_dim
        act = 2 * T * cfg.hidden_size * p
        if cfg.sparse_attention:
            return self._sparse_attention(reqs, T, decode, act)
        if decode:
            # absorbed MLA: W_UK folded into q, W_UV after attending over the latent
            pairs = sum(s + 1 for _, s in reqs)
            core = pairs * attention_flops_per_pair(cfg)
            kv = pairs * self._latent_bytes + T * self._latent_bytes   # read cache, write new
            return self._op("attention", cfg.num_hidden_layers, 2 * T * self._attn, core,
                            self._attn * p, kv + act)
        # naive MLA: expand K/V of all c + q tokens, causal within the chunk
        pairs = sum(causal_pairs(q, c) for q, c in reqs)
        expanded = sum(q + c for q, c in reqs)
        per_pair = attention_flops_per_token(cfg, 1) + 2 * H * R     # + the decoupled-RoPE dot
        proj = 2 * T * (self._attn - self._wkv_b) + 2 * expanded * self._wkv_b
        kv_rw = sum(c for _, c in reqs) * self._latent_bytes + T * self._latent_bytes
        kv_expanded = 2 * expanded * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * p
        return self._op("attention", cfg.num_hidden_layers, proj, pairs * per_pair,
                        self._attn * p, kv_rw + kv_expanded + act)

    def _sparse_attention(self, reqs, T, decode: bool, act: float) -> OpCost:
        """DSA: absorbed projections, the attention over the selected keys and the indexer
        over every pair (see the module docstring)."""
        cfg, p = self.cfg, self.dtype_bytes
        w = sparse_work(cfg, reqs, kv_row_bytes(cfg, "uniform", p))
        written = T * self._latent_bytes
        read = w.attention_bytes if decode else sum(c for _, c in reqs) * self._latent_bytes
        return self._op("attention", cfg.num_hidden_layers, 2 * T * self._attn, w.attention_flops + w.indexer_flops,
                        self._attn * p, read + w.indexer_bytes + written + act)

    def _dense_mlp(self, T) -> OpCost:
        p = self.dtype_bytes
        return self._op("dense_mlp", self.num_dense_layers, 2 * T * self._mlp, 0,
                        self._mlp * p, 2 * T * self.cfg.hidden_size * p)

    def _moe(self, T) -> OpCost:
        cfg, p = self.cfg, self.dtype_bytes
        E, k, D = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
        flops = 2 * T * ((k + cfg.n_shared_experts) * self._expert + self._router)
        touched = expected_distinct_experts(E, k, T) * self._expert * p
        act = 2 * T * D * p + 2 * T * k * D * p        # layer in/out, expert rows in/out
        return self._op("moe_experts", self.num_moe_layers, flops, 0,
                        (self._shared + self._router) * p, touched + act)

    def _a2a_bw(self) -> float:
        if self.a2a_bw is not None:
            return self.a2a_bw
        link = self.a2a_link
        if link == "auto":
            link = "scale_up" if self.ep_size <= GPUS_PER_NODE else "scale_out"
        return self.hw.link_bw(link)

    def _all_to_all(self, T) -> OpCost:
        """Dispatch + combine per accelerator: its T/ep tokens each go to k experts, of
        which a fraction (ep-1)/ep live elsewhere; hidden states of ``dtype_bytes``."""
        cfg, ep = self.cfg, self.ep_size
        sent = (T / ep) * cfg.num_experts_per_tok * cfg.hidden_size * self.dtype_bytes
        link_bytes = 2 * sent * (ep - 1) / ep
        return self._op("all_to_all", self.num_moe_layers, 0, 0, 0, 0, link_bytes, self._a2a_bw())

    def _lm_head(self, num_sampled) -> OpCost:
        p, V, D = self.dtype_bytes, self.cfg.vocab_size, self.cfg.hidden_size
        return self._op("lm_head", 1, 2 * num_sampled * D * V, 0, self._head * p,
                        num_sampled * (D * p + V * 4))    # fp32 logits out

    # ---- helpers -----------------------------------------------------------------------

    def _step_time(self, ops: dict) -> float:
        if not ops:
            return 0.0
        return sum(op.total_s for op in ops.values()) + self.efficiency.step_overhead_s

    @staticmethod
    def _check_chunks(chunks) -> list:
        if isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__iter__"):
            raise ValueError(f"chunks must be a list of (q, c) pairs, got {chunks!r}")
        out = []
        for i, item in enumerate(chunks):
            try:
                q, c = item
            except (TypeError, ValueError):
                raise ValueError(f"chunks[{i}] must be a (q, c) pair, got {item!r}") from None
            out.append((check_int(f"chunks[{i}] q", q, 1), check_int(f"chunks[{i}] c", c, 0)))
        return out

    def __repr__(self) -> str:
        return (f"RooflineCostModel(hw={self.hw.name!r}, dtype_bytes={self.dtype_bytes}, "
                f"ep_size={self.ep_size}, efficiency={self.efficiency})")
