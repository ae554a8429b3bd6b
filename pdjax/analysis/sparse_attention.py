"""DeepSeek-V3.2's sparse attention (DSA) as work: the FLOPs and bytes of its two parts in one
layer, from the config, for any step of requests ``[(q new tokens, c cached tokens)]`` (a
prefill chunk, or a decode request's 1 token, 2 with an MTP draft). Every cost model that
times DSA reads them from here (:mod:`pdjax.analysis.opmodel`, :mod:`pdjax.analysis.costmodel`,
``pdjax.sim.cost.LinearStepCost.from_roofline``).

With H heads, C kv_lora_rank, R qk_rope_head_dim, Hi / Di the indexer's heads and width and
k = index_topk, the i-th new token of a request (i = 1..q) sees c + i tokens (itself too):

* **the lightning indexer** scores all c + i of them: 2 Hi Di FLOPs a (query, key) pair
  (FP8 logits, then ReLU and the per-head weights), so q c + q (q + 1) / 2 pairs a request,
  :func:`~pdjax.analysis.roofline.causal_pairs`: O(T^2) in a prefill of T tokens, linear in the context in decode. It
  reads each key (and its scale) once per request and writes an FP32 logit per pair, which
  the top-k reads back (:data:`LOGIT_BYTES` = 4 + 4);
* **the sparse attention** attends min(c + i, k) of them (:func:`selected_pairs`: O(T k)),
  in MLA's MQA mode (FlashMLA's sparse kernels: the latent shared by all heads, the query
  absorbed), 2 H (2 C + R) FLOPs a pair
  (:func:`~pdjax.analysis.roofline.attention_flops_per_pair`, as dense absorbed decode), reading the selected rows' MLA part once per query.

The indexer's projections (``index_q``, ``index_k``, ``index_w``) are GEMMs and are counted
with the layer's others (:mod:`pdjax.analysis.layer_gemms`). Bytes per row come from a layout
of :func:`pdjax.analysis.kv.kv_row_bytes` (DeepSeek's kernels: 656 B MLA part, 132 B key).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pdjax.analysis.roofline import attention_flops_per_pair, causal_pairs
from pdjax.arguments import check_int

__all__ = ["LOGIT_BYTES", "SparseWork", "attention_flops_per_pair", "causal_pairs", "check_sparse",
           "indexer_flops_per_pair", "selected_pairs", "sparse_work"]

#: Bytes per (query, key) pair the indexer moves besides the keys: its FP32 logit, written by
#: the logits kernel (as DeepGEMM's benchmark counts it) and read back by the top-k.
LOGIT_BYTES = 4 + 4


def check_sparse(cfg) -> None:
    """ValueError unless ``cfg`` has DeepSeek sparse attention (``index_topk`` > 0)."""
    if not getattr(cfg, "sparse_attention", False):
        raise ValueError(f"{getattr(cfg, 'model_type', cfg)!r} has no sparse attention (index_topk == 0)")


def selected_pairs(q: int, c: int, k: int) -> int:
    """Keys the sparse attention reads for q new tokens over c cached ones, at most ``k`` a
    query: sum over i = 1..q of min(c + i, k) (exact, closed form)."""
    check_int("k", k)
    full = min(max(k - c, 0), q)             # queries that see at most k tokens: all of them selected
    return full * c + full * (full + 1) // 2 + (q - full) * k


def indexer_flops_per_pair(cfg) -> int:
    """FLOPs of one (query, key) pair of the indexer's logits: 2 Hi Di (V3.2: 16,384)."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim


@dataclasses.dataclass(frozen=True)
class SparseWork:
    """One layer's DSA work for a step: the sparse attention's and the indexer's FLOPs and
    bytes, and the pair counts they come from."""

    attention_flops: float
    attention_bytes: float
    indexer_flops: float
    indexer_bytes: float
    selected: int
    scored: int


def sparse_work(cfg, reqs: Sequence[tuple[int, int]], row: dict) -> SparseWork:
    """The DSA work of one layer for ``reqs`` [(q, c)], rows of ``row`` (a
    :func:`pdjax.analysis.kv.kv_row_bytes` dict: its ``mla`` and ``indexer`` bytes)."""
    check_sparse(cfg)
    k = cfg.index_topk
    selected = sum(selected_pairs(q, c, k) for q, c in reqs)
    scored = sum(causal_pairs(q, c) for q, c in reqs)
    keys = sum(q + c for q, c in reqs)
    return SparseWork(attention_flops=attention_flops_per_pair(cfg) * selected,
                      attention_bytes=row["mla"] * selected,
                      indexer_flops=indexer_flops_per_pair(cfg) * scored,
                      indexer_bytes=row["indexer"] * keys + LOGIT_BYTES * scored,
                      selected=selected, scored=scored)
