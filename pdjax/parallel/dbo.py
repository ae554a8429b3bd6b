"""Dual-batch overlap (DBO): split the batch into two micro-batches and interleave them so one
micro-batch's all-to-all can hide behind the other's compute, as DeepSeek's prefill does.

Program order inside each MoE layer (``run_layers_dbo``)::

    attn(0) dispatch(0) | attn(1) experts(0) dispatch(1) | combine(0) experts(1) | combine(1)

That is the lowered program's (StableHLO's) order. Per stream it is compute attn(0) attn(1)
experts(0) experts(1), communication dispatch(0) dispatch(1) combine(0) combine(1), the
order ``overlap_timeline`` assumes, and no collective depends on both micro-batches
(tests/parallel/test_dbo.py checks both on the lowered module).

Each micro-batch computes exactly what it would alone, so the output equals no overlap
(and the single-device model). Whether the communication actually overlaps is up to the
XLA scheduler and backend: the scheduler may reorder the program (XLA:CPU's scheduled HLO
is the same as for the halves run one after the other) and XLA:CPU runs collectives
synchronously. ``overlap_timeline`` predicts the step time with and without DBO from op
times, on two streams (compute and communication), for the experiment that plots the gain
against the compute:communication ratio: it is a view of the one overlap model,
:func:`pdjax.analysis.overlap.layer_program` scheduled by :func:`pdjax.analysis.streams.schedule`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pdjax.arguments import check_int
from pdjax.analysis.opmodel import LayerParts, Part
from pdjax.analysis.overlap import layer_program
from pdjax.analysis.streams import schedule
from pdjax.model import mla
from pdjax.model import moe as moe_lib
from pdjax.model.transformer import attention, layer
from pdjax.parallel.ep import ExpertParallel, ep_combine, ep_compute, ep_dispatch


@dataclasses.dataclass(frozen=True)
class DualBatchOverlap(ExpertParallel):
    """Expert parallelism with dual-batch overlap: the model's layer loop is replaced by the
    interleaved two-micro-batch loop. Batch halves must each divide over the batch axes."""

    def run_layers(self, params, cfg, x_BTD, q_pos_BT, kv_layers, start_B, absorbed, valid_BT=None):
        return run_layers_dbo(params, cfg, x_BTD, q_pos_BT, kv_layers, start_B, absorbed, self, valid_BT)


def _halves(x):
    if x is None:
        return None, None
    b = x.shape[0] // 2
    return x[:b], x[b:]


def run_layers_dbo(params, cfg, x_BTD, q_pos_BT, kv_layers, start_B, absorbed, ep: ExpertParallel,
                   valid_BT=None):
    B = x_BTD.shape[0]
    if B % 2 or (B // 2) % ep.batch_size:
        raise ValueError(f"dual-batch overlap splits batch {B} in two halves that must each divide over "
                         f"the batch axes {ep.batch_axes} (size {ep.batch_size})")
    x, q_pos, start, valid = list(_halves(x_BTD)), _halves(q_pos_BT), _halves(start_B), _halves(valid_BT)
    eps = cfg.rms_norm_eps
    new_kv = []
    for l, lp in enumerate(params["layers"]):
        kv = _halves(None if kv_layers is None else kv_layers[l])
        if "moe" not in lp:
            outs = [layer(lp, cfg, x[m], q_pos[m], kv[m], start[m], absorbed, ep, valid[m]) for m in (0, 1)]
            x = [o[0] for o in outs]
            new_kv.append(jnp.concatenate([o[1] for o in outs]))
            continue
        p = lp["moe"]

        def attend(m):
            a, kv_m = attention(lp, cfg, mla.rms_norm(x[m], lp["attn_norm"], eps), q_pos[m], kv[m],
                                start[m], absorbed)
            h = x[m] + a
            return h, mla.rms_norm(h, lp["ffn_norm"], eps), kv_m

        def flat(t):
            return t.reshape(-1, t.shape[-1])

        def flat_valid(m):
            return None if valid[m] is None else valid[m].reshape(-1)

        h0, n0, kv0 = attend(0)
        s0, drop0 = ep_dispatch(p, cfg, flat(n0), ep, flat_valid(0))   # a2a(0) in flight ...
        h1, n1, kv1 = attend(1)                                 # ... under attn(1)
        r0 = ep_compute(p, s0, ep)
        s1, drop1 = ep_dispatch(p, cfg, flat(n1), ep, flat_valid(1))   # a2a(1) under experts(0)
        y0 = ep_combine(r0, s0, ep, n0.dtype)
        r1 = ep_compute(p, s1, ep)                              # experts(1) under combine(0)
        y1 = ep_combine(r1, s1, ep, n1.dtype)
        moe_lib.record_stat(drop0 + drop1)
        out = []
        for h, n, y in ((h0, n0, y0), (h1, n1, y1)):
            y = y.reshape(h.shape)
            if cfg.n_shared_experts:
                y = y + moe_lib.shared_experts(p, cfg, n)
            out.append(h + y)
        x = out
        new_kv.append(jnp.concatenate([kv0, kv1]))
    return jnp.concatenate(x), new_kv


# ---- timeline model: a view of the one overlap model (pdjax.analysis.streams) ---------------

_EVENT_KIND = {"a": "A", "d": "D", "e": "E", "c": "C"}      # op name's first letter -> event's


def overlap_timeline(t_attn: float, t_experts: float, t_dispatch: float, t_combine: float | None = None,
                     num_layers: int = 1, dbo: bool = True) -> dict:
    """Predicted step time of ``num_layers`` MoE layers on two streams (compute, comm): a view
    of the one overlap model, :func:`pdjax.analysis.overlap.layer_program` for one
    micro-batch (``dbo=False``) or two, scheduled by :func:`pdjax.analysis.streams.schedule`
    (each stream runs its ops in program order, each as early as its inputs allow; no SM
    contention).

    Times are for the whole batch; with DBO each op takes half its time per micro-batch.
    Returns {"makespan", "compute_busy", "comm_busy", "events": [(stream, name, start, end)]},
    events in program order, named by kind (A attention, D dispatch, E experts, C combine),
    micro-batch and layer: "E1.0" is micro-batch 1's experts in layer 0.
    """
    for name, v in (("t_attn", t_attn), ("t_experts", t_experts), ("t_dispatch", t_dispatch)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    t_combine = t_dispatch if t_combine is None else t_combine
    if not t_combine >= 0:
        raise ValueError(f"t_combine must be >= 0, got {t_combine}")
    check_int("num_layers", num_layers)
    f = 0.5 if dbo else 1.0
    lp = LayerParts(attn=Part(attention=t_attn * f), experts=Part(gemm=t_experts * f),
                    dispatch=Part(comm=t_dispatch * f), combine=Part(comm=t_combine * f))
    spans = schedule(layer_program([lp] * num_layers, 2 if dbo else 1, comm_holds_sms=False))
    events = []
    for s in spans:
        if s.label[0] in _EVENT_KIND:                     # the shared expert (none here) left out
            layer, mb = s.label[1:].split(".")[:2]
            events.append((s.stream, f"{_EVENT_KIND[s.label[0]]}{mb}.{layer}", s.start_s, s.end_s))
    busy = {st: sum((e - b for stream, _, b, e in events if stream == st), 0.0) for st in ("compute", "comm")}
    return {"makespan": max(s.end_s for s in spans), "compute_busy": busy["compute"], "comm_busy": busy["comm"],
            "events": events}


def dbo_gain(t_compute: float, t_comm: float, attn_share: float = 0.5, num_layers: int = 4) -> float:
    """Predicted speed-up of DBO over serial execution for a compute time split between
    attention (``attn_share``) and experts, and a communication time split evenly between
    dispatch and combine: the ratio of two :func:`overlap_timeline` makespans."""
    if not 0 <= attn_share <= 1:
        raise ValueError(f"attn_share must be in [0, 1], got {attn_share}")
    args = (t_compute * attn_share, t_compute * (1 - attn_share), t_comm / 2, t_comm / 2, num_layers)
    return overlap_timeline(*args, dbo=False)["makespan"] / overlap_timeline(*args, dbo=True)["makespan"]
