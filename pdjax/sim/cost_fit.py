"""The serving simulator's step cost as a view of the op-level deployment model: a
:class:`~pdjax.sim.cost.LinearStepCost` fitted once per deployment to
:func:`pdjax.analysis.predict`, so the simulator and the analysis share one source of truth
and the event loop keeps its constant-time linear step (never a prediction per event).

A prefill instance is ``prefill.gpus`` GPUs, a decode instance ``decode.gpus`` GPUs, as in
the two :class:`~pdjax.analysis.Deployment` s given. The prefill coefficients
(c0 + c1 sum q + c2 sum q c + c3 sum q^2 + c4 sum c) are a non-negative least-squares fit
over whole-prompt batches of several prompt lengths, cached prefixes and batch sizes; the
decode coefficients (d0 + d1 n + d2 sum kv) over several batch sizes and KV lengths, split
into the attention side (a0, a1) and the FFN side (f0, f1) by the median share of attention
kernels in the attention + GEMM time of the samples (a coarse split: AF experiments that
need it exact should time the two sides themselves). The fit's largest relative error is in the cost's ``note``.

With DeepSeek-V3.2's sparse attention the fit has one more column each, the keys the
attention selects (c5: sum of selected(q, c) over the prompts; d3: min(kv + 1, k) per request,
:mod:`pdjax.analysis.sparse_attention`), so that the attention stays flat beyond index_topk
while the indexer (c2, c3, d2) grows with the context; the KV bytes are the layout DeepSeek's
kernels read (:func:`pdjax.analysis.kv.serving_kv_bytes_per_token`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdjax.analysis import memory_fit
from pdjax.analysis.deploy import Deployment, predict
from pdjax.analysis.kv import serving_kv_bytes_per_token
from pdjax.analysis.sparse_attention import selected_pairs
from pdjax.sim.cost import LinearStepCost

PREFILL_PROMPTS = (1024, 2048, 4096, 8192)
PREFILL_CACHED = (0, 4096)
PREFILL_TOKENS_PER_GPU = (4096, 16384)
DECODE_BATCHES = (16, 64, 128, 256)
DECODE_KV = (1024, 4096, 16384)


def _nnls(rows: list, times: list) -> tuple[np.ndarray, float]:
    """Non-negative least squares in relative error: coefficients and the largest |relative error|."""
    from scipy.optimize import nnls
    A = np.array(rows, float)
    y = np.array(times, float)
    w = 1.0 / y
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale * w[:, None], y * w)
    coef /= scale
    return coef, float(np.max(np.abs(A @ coef / y - 1)))


def _prefill_samples(d: Deployment) -> tuple[list, list]:
    G, rows, times, k = d.gpus, [], [], d.model.index_topk
    for L in PREFILL_PROMPTS:
        for c in PREFILL_CACHED:
            for per_gpu in PREFILL_TOKENS_PER_GPU:
                q = L
                p = predict(dataclasses.replace(d, input_len=q + c, cache_hit_rate=c / (q + c),
                                                batch_per_gpu=per_gpu * (q + c) // q))
                prompts = per_gpu * G / q
                rows.append([1.0, prompts * q, prompts * q * c, prompts * q * q, prompts * c]
                            + ([prompts * selected_pairs(q, c, k)] if k else []))
                times.append(p.step_time_s)
    return rows, times


def _decode_samples(d: Deployment) -> tuple[list, list, float]:
    G, rows, times, shares, k = d.gpus, [], [], [], d.model.index_topk
    for n in DECODE_BATCHES:
        for kv in DECODE_KV:
            p = predict(dataclasses.replace(d, batch_per_gpu=n, input_len=kv, output_len=1, mtp=None))
            rows.append([1.0, n * G, n * G * kv] + ([n * G * selected_pairs(1, kv, k)] if k else []))
            times.append(p.step_time_s)
            b = p.breakdown
            attn = b["attention"] + b["indexer"]
            shares.append(attn / max(1e-30, attn + b["gemm"]))
    return rows, times, float(np.median(shares))


def linear_cost_from_deployments(prefill: Deployment, decode: Deployment) -> LinearStepCost:
    """A :class:`LinearStepCost` fitted to :func:`pdjax.analysis.predict` of ``prefill``
    (role "prefill") and ``decode`` (role "decode") deployments of one model."""
    if prefill.role != "prefill" or decode.role != "decode":
        raise ValueError(f"linear_cost_from_deployments needs a prefill and a decode Deployment, got roles "
                         f"{prefill.role!r} and {decode.role!r}")
    if prefill.model != decode.model:
        raise ValueError("the prefill and decode deployments run different models")
    cfg = prefill.model
    (c0, c1, c2, c3, c4, *c5), err_p = _nnls(*_prefill_samples(prefill))
    rows, times, attn_share = _decode_samples(decode)
    (d0, d1, d2, *d3), err_d = _nnls(rows, times)
    sparse = dict(sparse_topk=cfg.index_topk, c5=float(c5[0]), d3=float(d3[0])) if cfg.sparse_attention else {}
    kv_b = serving_kv_bytes_per_token(cfg)
    hbm = decode.hardware.require("hbm_bytes", "the KV capacity")
    free = (hbm * (1 - memory_fit.ACTIVATION_RESERVE) - memory_fit.weight_bytes_per_gpu(decode)) * decode.gpus
    c0, c1, c2, c3, c4, d0, d1, d2 = map(float, (c0, c1, c2, c3, c4, d0, d1, d2))
    return LinearStepCost(
        c0=c0, c1=c1, c2=c2, c3=c3, c4=c4, a0=d0 * attn_share, a1=d1 * attn_share,
        f0=d0 * (1 - attn_share), f1=d1 * (1 - attn_share), d2=d2, kv_bytes=int(kv_b),
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, act_bytes=2,
        experts_per_token=max(1, cfg.num_experts_per_tok), kv_capacity=max(0.0, free / kv_b) or None, cfg=cfg,
        note=(f"fit of pdjax.analysis.predict: prefill {prefill.gpus} x {prefill.hardware.name} EP{prefill.ep}, "
              f"decode {decode.gpus} x {decode.hardware.name} EP{decode.ep}; largest fit error prefill "
              f"{err_p:.1%}, decode {err_d:.1%}"), **sparse)
