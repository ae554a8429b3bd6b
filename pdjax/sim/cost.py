"""Step-time cost models for the serving simulator.

The simulator asks a cost model four questions (:class:`StepCostModel`); any object with
these methods works, e.g. ``pdjax.analysis.costmodel.RooflineCostModel``:

* ``prefill_step_time(chunks)``: seconds of one batched prefill step, ``chunks`` a list
  of ``(q, c)`` pairs (q new tokens of a request, c tokens of it already cached);
* ``decode_step_time(kv_lens)``: seconds of one decode step of ``len(kv_lens)`` requests,
  each attending to ``kv_lens[i]`` cached tokens;
* ``kv_transfer_time(num_tokens, link_bw)``: seconds to push ``num_tokens`` tokens of KV
  over a link of ``link_bw`` bytes/s;
* ``kv_bytes_per_token()``: KV bytes per token over all layers.

Optional: ``decode_overhead(joined, left)``, seconds a decode step's iteration adds for the
requests that joined that step and those that left after the step before (an engine's
handoff work between steps); the simulator adds it when the model has it.

AF disaggregation additionally needs the decode step split into its attention side and
its FFN side (:class:`AFDCostModel`): ``decode_attention_time(kv_lens)`` and
``decode_ffn_time(num_tokens)``.

:class:`LinearStepCost` is the simple linear model of Vidur / DistServe:

    prefill = c0 + c1 * sum(q) + c2 * sum(q*c) + c3 * sum(q^2) + c4 * sum(c)
    decode  = d0 + d1 * n + d2 * sum(kv_lens)
    kv transfer = tokens * kv_bytes_per_token / bw

``LinearStepCost.from_roofline(cfg, hw)`` derives every coefficient from a ModelConfig
and a hardware preset (see its docstring); nothing is typed in.

With DeepSeek-V3.2's sparse attention (``sparse_topk`` = index_topk > 0) the attention of a
new token reads only min(its context, k) cached tokens, which no sum over the requests
gives: two terms are added, per request or chunk (:mod:`pdjax.analysis.sparse_attention`),

    prefill += c5 * sum(selected(q, c))        selected(q, c) = sum_{i=1..q} min(c + i, k)
    decode  += d3 * sum(selected(1, kv))       = min(kv + 1, k) per request

(c2, c3 and d2 then hold the indexer, which scores every pair), and the simulator uses the
per-request methods (:func:`has_totals` is False for such a cost).

:class:`FittedStepCost` wraps costs fitted to an engine's measured steps (a
``pdjax.analysis.costmodel_fit.PrefillCostFit`` and ``DecodeCostFit``), so the simulator can
replay a trace against the engine it models (``pdjax.experiments.sim_vs_engine``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

from pdjax.arguments import check_int
from pdjax.analysis.afd_bounds import afd_exchange_bytes
from pdjax.analysis.sparse_attention import selected_pairs
from pdjax.sim.cost_roofline import roofline_fields

PROTOCOL_METHODS = ("prefill_step_time", "decode_step_time", "kv_transfer_time",
                    "kv_bytes_per_token")
AFD_METHODS = ("decode_attention_time", "decode_ffn_time")


@runtime_checkable
class StepCostModel(Protocol):
    """What the simulator needs from a cost model (all times in seconds)."""

    def prefill_step_time(self, chunks: Sequence[tuple[int, int]]) -> float: ...

    def decode_step_time(self, kv_lens: Sequence[int]) -> float: ...

    def kv_transfer_time(self, num_tokens: int, link_bw: float) -> float: ...

    def kv_bytes_per_token(self) -> int: ...


@runtime_checkable
class AFDCostModel(StepCostModel, Protocol):
    """A cost model that can split a decode step into attention and FFN sides."""

    def decode_attention_time(self, kv_lens: Sequence[int]) -> float: ...

    def decode_ffn_time(self, num_tokens: int) -> float: ...


def check_cost_model(cost, afd: bool = False):
    """Return ``cost`` if it has the protocol's methods, else TypeError naming the missing."""
    needed = PROTOCOL_METHODS + (AFD_METHODS if afd else ())
    missing = [m for m in needed if not callable(getattr(cost, m, None))]
    if missing:
        what = "an AF-disaggregated deployment" if afd else "the serving simulator"
        raise TypeError(f"cost model {type(cost).__name__} lacks {missing}, needed by {what}")
    return cost


def has_totals(cost, name: str) -> bool:
    """Whether the simulator may call ``cost``'s fast path ``name`` (a ``*_totals`` method):
    it has one and its step time follows from the totals alone (not with sparse attention,
    whose cost depends on each request's min(context, index_topk))."""
    return callable(getattr(cost, name, None)) and not getattr(cost, "sparse_topk", 0)


def num_layers_of(cost, default: int = 1) -> int:
    """Layer count of a cost model (``num_layers`` or ``cfg.num_hidden_layers``)."""
    n = getattr(cost, "num_layers", None)
    if n is None:
        cfg = getattr(cost, "cfg", None)
        n = getattr(cfg, "num_hidden_layers", None)
    return int(n) if n else default


@dataclasses.dataclass(frozen=True)
class LinearStepCost:
    """Linear step-time model; all coefficients in seconds (per step, per token, per
    token pair). The decode step splits into an attention side (``a0 + a1*n + d2*sum(kv)``,
    + ``d3*sum(selected)`` with sparse attention) and an FFN side (``f0 + f1*n``) so that
    ``d0 = a0 + f0`` and ``d1 = a1 + f1``. ``sparse_topk``, ``c5``, ``d3``: DeepSeek sparse
    attention (see the module docstring; 0: dense).

    Use :meth:`from_roofline` for coefficients derived from a config and a hardware preset;
    pass coefficients directly for a fitted model.
    """

    c0: float
    c1: float
    c2: float
    c3: float
    a0: float
    a1: float
    f0: float
    f1: float
    d2: float
    kv_bytes: int
    c4: float = 0.0
    num_layers: int = 1
    hidden_size: int = 0
    act_bytes: int = 2
    experts_per_token: int = 1
    kv_capacity: Optional[float] = None        # tokens an instance can hold (colocated/decode)
    kv_capacity_attention: Optional[float] = None  # tokens an AF attention instance can hold
    cfg: object = dataclasses.field(default=None, repr=False, compare=False)
    note: str = ""
    sparse_topk: int = 0
    c5: float = 0.0
    d3: float = 0.0

    def __post_init__(self):
        for f in ("c0", "c1", "c2", "c3", "c4", "a0", "a1", "f0", "f1", "d2", "c5", "d3"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"LinearStepCost.{f} must be a finite number >= 0, got {v!r}")
        if self.kv_bytes <= 0:
            raise ValueError(f"LinearStepCost.kv_bytes must be > 0, got {self.kv_bytes!r}")
        check_int("LinearStepCost.sparse_topk", self.sparse_topk, 0)
        if not self.sparse_topk and (self.c5 or self.d3):
            raise ValueError("LinearStepCost.c5 and d3 (sparse attention terms) need sparse_topk > 0")

    # ---- derived coefficients -------------------------------------------------------
    @property
    def d0(self) -> float:
        return self.a0 + self.f0

    @property
    def d1(self) -> float:
        return self.a1 + self.f1

    # ---- protocol --------------------------------------------------------------------
    def prefill_step_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        sq = sqc = sq2 = sc = 0
        for q, c in chunks:
            sq += q
            sqc += q * c
            sq2 += q * q
            sc += c
        dense = self._prefill_totals(sq, sqc, sq2, sc)
        if not self.sparse_topk:
            return dense
        return dense + self.c5 * sum(selected_pairs(q, c, self.sparse_topk) for q, c in chunks)

    def prefill_step_time_totals(self, sum_q, sum_qc, sum_q2, sum_c=0) -> float:
        """Fast path: the prefill step time from the sums over its chunks (dense attention only)."""
        self._no_totals("prefill_step_time")
        return self._prefill_totals(sum_q, sum_qc, sum_q2, sum_c)

    def _prefill_totals(self, sum_q, sum_qc, sum_q2, sum_c) -> float:
        return self.c0 + self.c1 * sum_q + self.c2 * sum_qc + self.c3 * sum_q2 + self.c4 * sum_c

    def _no_totals(self, method: str) -> None:
        if self.sparse_topk:
            raise ValueError(f"a sparse-attention cost (sparse_topk={self.sparse_topk}) needs each request's "
                             f"context: call {method}")

    def _selected(self, kv_lens) -> float:
        """d3 x the keys each request's new token selects, min(kv + 1, k) (0 when dense)."""
        k = self.sparse_topk
        if not k:
            return 0.0
        # selected_pairs(1, kv, k) inlined: the simulator calls this once a decode step over its whole batch
        return self.d3 * sum(kv + 1 if kv + 1 < k else k for kv in kv_lens)

    def decode_step_time(self, kv_lens: Sequence[int]) -> float:
        if not len(kv_lens):
            return 0.0
        t = self.d0 + self.d1 * len(kv_lens) + self.d2 * sum(kv_lens)
        return t + self._selected(kv_lens) if self.sparse_topk else t

    def decode_step_time_totals(self, n: int, sum_kv: float) -> float:
        """Fast path: decode step time of ``n`` requests holding ``sum_kv`` tokens in all
        (dense attention only)."""
        self._no_totals("decode_step_time")
        return self.d0 + self.d1 * n + self.d2 * sum_kv

    def decode_attention_time(self, kv_lens: Sequence[int]) -> float:
        """Attention side of a decode step (all layers): attention weights, per-token
        attention-side FLOPs and the KV read (and the indexer, with sparse attention)."""
        if not len(kv_lens):
            return 0.0
        t = self.a0 + self.a1 * len(kv_lens) + self.d2 * sum(kv_lens)
        return t + self._selected(kv_lens) if self.sparse_topk else t

    def decode_attention_time_totals(self, n: int, sum_kv: float) -> float:
        self._no_totals("decode_attention_time")
        return self.a0 + self.a1 * n + self.d2 * sum_kv if n else 0.0

    def decode_ffn_time(self, num_tokens: int) -> float:
        """FFN side of a decode step (all layers): expert / MLP weights and FLOPs."""
        return self.f0 + self.f1 * num_tokens if num_tokens else 0.0

    def kv_transfer_time(self, num_tokens: int, link_bw: float) -> float:
        if not (isinstance(link_bw, (int, float)) and link_bw > 0 and math.isfinite(link_bw)):
            raise ValueError(f"link_bw must be a positive number of bytes/s, got {link_bw!r}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
        return num_tokens * self.kv_bytes / link_bw

    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes

    def afd_exchange_bytes(self, num_ffn: int) -> float:
        """One-way bytes per token per layer of the attention<->FFN exchange: the hidden
        state (``act_bytes`` per element) sent to min(top-k, N) FFN instances."""
        return afd_exchange_bytes(self.hidden_size, self.experts_per_token, num_ffn, self.act_bytes)

    # ---- derivation ------------------------------------------------------------------
    @classmethod
    def from_roofline(cls, cfg, hw, dtype: str = "bf16", dtype_bytes: Optional[float] = None,
                      kv_dtype_bytes: Optional[float] = None, ep_size: int = 1,
                      mfu: float = 1.0, mbu: float = 1.0, kv_layout: str = "uniform") -> "LinearStepCost":
        """Coefficients from a roofline of ``cfg`` on ``ep_size`` accelerators ``hw``.

        With R = ep_size * peak(dtype) * mfu, BW = ep_size * hbm_bw * mbu, p = weight
        bytes, N_a the active params (pdjax.analysis.param_counts):

        * c0 = a0 + f0 = weight bytes read per step / BW (every weight but the input
          embedding, a row lookup; all experts are assumed touched), the memory floor;
        * c1 = 2 * N_a / R (weight FLOPs per new token);
        * c2 = attention FLOPs per (new token, cached token) pair / R
          (``attention_flops_per_token(cfg, 1)`` per layer, all layers); c3 = c2 / 2
          (causal: q new tokens form ~q^2/2 pairs); c4 = KV bytes per token / BW (reading
          a chunk's cached prefix once);
        * decode: a1 + f1 = c1 split into attention-side and FFN-side params (FFN side =
          routed + shared experts + dense MLPs), a0 / f0 the matching weight reads;
          d2 = max(KV bytes per token / BW, attention FLOPs per cached token / R).

        The linear form adds the memory floor to the compute term: exact in both limits,
        up to 2x pessimistic at the balance point (the Vidur/DistServe form). ``mfu`` and
        ``mbu`` (default 1: pure roofline) scale peak compute and bandwidth. A hardware
        spec without a needed figure raises ValueError (from ``HardwareSpec.require``).
        ``kv_capacity`` = (ep_size * HBM - all weights) / KV bytes per token;
        ``kv_capacity_attention`` the same with the attention-side weights only. KV bytes
        are ``kv_dtype_bytes`` per cached value (``kv_layout="uniform"``, the indexer key
        included with sparse attention) or DeepSeek's FP8 row (``"deepseek-fp8"``,
        :func:`pdjax.analysis.kv.kv_row_bytes`).

        With sparse attention (DeepSeek-V3.2) the attention is MLA's MQA mode over the
        selected keys and the indexer scores every pair
        (:mod:`pdjax.analysis.sparse_attention`): c2 = the indexer's FLOPs per pair / R,
        c3 = c2 / 2, c5 = the sparse attention's FLOPs per selected pair / R; d2 =
        max((indexer key + logit bytes) / BW, c2) per cached token, d3 = max(MLA row bytes /
        BW, c5) per selected one (all layers). The masked dense form DeepSeek runs for short
        prompts is not in this roofline (it is in :func:`pdjax.analysis.predict`).
        """
        return cls(**roofline_fields(cfg, hw, dtype, dtype_bytes, kv_dtype_bytes, ep_size, mfu, mbu, kv_layout))


@dataclasses.dataclass(frozen=True)
class FittedStepCost:
    """A step cost model from costs fitted to an engine's measured steps.

    * ``prefill(q, c)``: seconds of one prefill call of q new tokens over c cached ones
      (e.g. a :class:`~pdjax.analysis.costmodel_fit.PrefillCostFit`); a step of several
      chunks costs the sum of its chunks (one call each, as pdjax's prefill pools run one
      request per call). ``prefill_rows(q)``: the rows the engine really computes for a
      chunk of q tokens (its padding bucket; None: q), applied before ``prefill``.
    * ``decode(B, K)``: seconds of one decode step of B requests holding K cached tokens in
      all (e.g. a :class:`~pdjax.analysis.costmodel_fit.DecodeCostFit`).
    * ``kv_bytes``: KV bytes per token over all layers (what a handoff moves);
      ``num_layers``: layers of the layer-wise transfer.
    """

    prefill: Callable
    decode: Callable
    kv_bytes: int
    num_layers: int = 1
    prefill_rows: Optional[Callable] = None

    def __post_init__(self):
        if not callable(self.prefill) or not callable(self.decode):
            raise ValueError("FittedStepCost needs callables prefill(q, c) and decode(B, K)")
        if self.prefill_rows is not None and not callable(self.prefill_rows):
            raise ValueError("FittedStepCost.prefill_rows must be a callable q -> rows or None")
        if isinstance(self.kv_bytes, bool) or not isinstance(self.kv_bytes, (int, float)) or self.kv_bytes <= 0:
            raise ValueError(f"FittedStepCost.kv_bytes must be > 0, got {self.kv_bytes!r}")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"FittedStepCost.num_layers must be an integer >= 1, got {self.num_layers!r}")

    def prefill_step_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Sum over the chunks of prefill(rows(q), c) seconds."""
        rows = self.prefill_rows or (lambda q: q)
        return float(sum(self.prefill(rows(q), c) for q, c in chunks if q > 0))

    def decode_step_time(self, kv_lens: Sequence[int]) -> float:
        """decode(len(kv_lens), sum(kv_lens)) seconds (0 for an empty batch)."""
        if not len(kv_lens):
            return 0.0
        return self.decode_step_time_totals(len(kv_lens), sum(kv_lens))

    def decode_step_time_totals(self, n: int, sum_kv: float) -> float:
        """Fast path: decode(n, sum_kv) seconds."""
        return float(self.decode(n, sum_kv)) if n else 0.0

    def decode_overhead(self, joined: int, left: int) -> float:
        """``decode.overhead(joined, left)`` seconds when the decode fit has handoff terms
        (:class:`~pdjax.analysis.costmodel_fit.DecodeCostFit` with dj / dl), else 0."""
        f = getattr(self.decode, "overhead", None)
        return float(f(joined, left)) if f is not None and (joined or left) else 0.0

    def kv_transfer_time(self, num_tokens: int, link_bw: float) -> float:
        """``num_tokens * kv_bytes / link_bw`` seconds."""
        if not (isinstance(link_bw, (int, float)) and link_bw > 0 and math.isfinite(link_bw)):
            raise ValueError(f"link_bw must be a positive number of bytes/s, got {link_bw!r}")
        return num_tokens * self.kv_bytes / link_bw

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token over all layers."""
        return self.kv_bytes
