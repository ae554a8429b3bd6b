"""Micro-batch overlap on streams: the programs DeepSeek-style deployments and AF-disaggregated
decode run, as :class:`~pdjax.analysis.streams.Op` lists for
:func:`~pdjax.analysis.streams.schedule`. The one overlap model of pdjax (pdjax.parallel.dbo's
``overlap_timeline`` and pdjax.sim.afd_step are views of it).

* :func:`layer_program`: the layers of an inference step for one micro-batch (no overlap)
  or two (two-batch overlap, TBO / DBO). Per layer, the compute stream runs attention of
  every micro-batch, then each micro-batch's shared expert and routed experts; the
  communication stream runs every micro-batch's dispatch, then every combine. A
  micro-batch's dispatch waits for its attention, its routed experts for its dispatch, its
  combine for its experts and its next layer's attention for its combine: so one
  micro-batch's all-to-all runs under the other's compute (SGLang's and DeepSeek's order).
* :func:`dualpipe_pair_program`: one DualPipe forward & backward chunk pair, in the issue
  order of DeepSeek's train.json: per layer combine(B), attn(F), mlp(B), dispatch(F),
  dispatch(B), mlp(W), mlp(F), attn(B), attn(W), combine(F), where "(B)" of a combine runs a
  dispatch kernel and vice versa (the backward of an all-to-all is the other one).
* :func:`af_program`: AF ping-pong (MegaScale-Infer style) on the streams "attention", "a2f",
  "ffn", "f2a": per layer every micro-batch's attention and A2F, then every one's FFN and
  F2A (the host's issue order); a micro-batch's A2F waits for its attention, its FFN for its
  A2F, its F2A for its FFN and its next layer's attention for its F2A. Each stream serves
  the micro-batches round-robin, one at a time (a link carries one micro-batch's hidden
  states at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pdjax.analysis.opmodel import LayerParts, Part
from pdjax.analysis.streams import Op, Span, schedule

_CLASSES = ("other", "gemm", "indexer", "attention")


def _compute_ops(name: str, part: Part, after: tuple, group: str) -> list[Op]:
    """One compute part as consecutive ops, one per non-empty class (the first waits for ``after``)."""
    classes = [cls for cls in _CLASSES if getattr(part, cls) > 0] or ["other"]   # an empty part: one 0 s op
    return [Op(f"{name}.{cls}", "compute", cls, getattr(part, cls), after if i == 0 else (), group=group)
            for i, cls in enumerate(classes)]


def _comm_op(name: str, cls: str, part: Part, after: str, holds_sms: bool, group: str) -> Op:
    return Op(name, "comm", cls, part.comm, (after,), holds_sms=holds_sms, group=group)


def layer_program(layers: Sequence[LayerParts], microbatches: int, *, comm_holds_sms: bool) -> list[Op]:
    """The ops of ``layers`` (one :class:`LayerParts` each, per micro-batch) for
    ``microbatches`` (1 or 2) micro-batches; see the module docstring."""
    if microbatches not in (1, 2):
        raise ValueError(f"microbatches must be 1 or 2, got {microbatches!r}")
    ops: list[Op] = []
    last = [None] * microbatches                 # last op of each micro-batch so far
    for l, lp in enumerate(layers):
        is_moe = lp.dense.compute == 0           # no dense MLP: an MoE layer (its parts may take 0 s)
        for mb in range(microbatches):
            block = _compute_ops(f"a{l}.{mb}", lp.attn, (last[mb],) if last[mb] else (), "attn")
            ops += block
            last[mb] = block[-1].name
        if not is_moe:
            for mb in range(microbatches):
                block = _compute_ops(f"f{l}.{mb}", lp.dense, (last[mb],), "mlp")
                ops += block
                last[mb] = block[-1].name
            continue
        for mb in range(microbatches):
            ops.append(_comm_op(f"d{l}.{mb}", "dispatch", lp.dispatch, last[mb], comm_holds_sms, "dispatch"))
        for mb in range(microbatches):
            ops += _compute_ops(f"s{l}.{mb}", lp.shared, (last[mb],), "mlp")
            block = _compute_ops(f"e{l}.{mb}", lp.experts, (f"d{l}.{mb}",), "mlp")
            ops += block
            last[mb] = block[-1].name
        for mb in range(microbatches):
            ops.append(_comm_op(f"c{l}.{mb}", "combine", lp.combine, last[mb], comm_holds_sms, "combine"))
            last[mb] = f"c{l}.{mb}"
    return ops


@dataclasses.dataclass(frozen=True)
class PairParts:
    """One layer of a DualPipe chunk pair: forward parts (``attn_f``, ``mlp_f``, ``dispatch_f``,
    ``combine_f``), backward (``attn_b``, ``mlp_b``, and its all-to-alls ``combine_b`` (a
    dispatch kernel) and ``dispatch_b`` (a combine kernel)), weight gradients (``attn_w``,
    ``mlp_w``)."""

    attn_f: Part
    mlp_f: Part
    dispatch_f: Part
    combine_f: Part
    attn_b: Part
    mlp_b: Part
    combine_b: Part
    dispatch_b: Part
    attn_w: Part
    mlp_w: Part


def dualpipe_pair_program(layers: Sequence[PairParts], *, comm_holds_sms: bool = True) -> list[Op]:
    """The ops of a DualPipe forward & backward chunk pair of ``len(layers)`` layers."""
    ops: list[Op] = []
    prev_f = prev_b = None
    for l, p in enumerate(layers):
        ops.append(Op(f"cB{l}", "comm", "dispatch", p.combine_b.comm, (prev_b,) if prev_b else (),
                      holds_sms=comm_holds_sms, group="combine(B)"))
        a_f = _compute_ops(f"aF{l}", p.attn_f, (prev_f,) if prev_f else (), "attn(F)")
        m_b = _compute_ops(f"mB{l}", p.mlp_b, (f"cB{l}",), "mlp(B)")
        ops += a_f + m_b
        ops.append(_comm_op(f"dF{l}", "dispatch", p.dispatch_f, a_f[-1].name, comm_holds_sms, "dispatch(F)"))
        ops.append(Op(f"dB{l}", "comm", "combine", p.dispatch_b.comm, (m_b[-1].name,),
                      holds_sms=comm_holds_sms, group="dispatch(B)"))
        m_w = _compute_ops(f"mW{l}", p.mlp_w, (m_b[-1].name,), "mlp(W)")
        m_f = _compute_ops(f"mF{l}", p.mlp_f, (f"dF{l}",), "mlp(F)")
        a_b = _compute_ops(f"aB{l}", p.attn_b, (f"dB{l}",), "attn(B)")
        a_w = _compute_ops(f"aW{l}", p.attn_w, (a_b[-1].name,), "attn(W)")
        ops += m_w + m_f + a_b + a_w
        ops.append(_comm_op(f"cF{l}", "combine", p.combine_f, m_f[-1].name, comm_holds_sms, "combine(F)"))
        prev_f, prev_b = f"cF{l}", a_b[-1].name
    return ops


@dataclasses.dataclass(frozen=True)
class AFStages:
    """Seconds of one layer of one micro-batch in an AF unit: ``attn`` (the attention side),
    ``a2f`` (its hidden states to the FFN side), ``ffn`` (the FFN side), ``f2a`` (back)."""

    attn: float
    a2f: float
    ffn: float
    f2a: float


def af_program(layers: Sequence[AFStages], microbatches: int, *, head: float = 0.0,
               one_device: bool = False) -> list[Op]:
    """AF ping-pong of ``microbatches`` micro-batches through ``len(layers)`` layers, on the
    streams "attention", "a2f", "ffn", "f2a" (see the module docstring); ``head``: seconds
    of each micro-batch's last attention-side segment (final norm and LM head) after the
    last layer. ``one_device``: the attention and FFN programs share one resource
    ("compute", as XLA:CPU runs both meshes' programs one at a time in issue order)."""
    m = microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches must be a positive integer, got {m!r}")
    attn, ffn = ("compute", "compute") if one_device else ("attention", "ffn")
    ops: list[Op] = []
    last: list = [None] * m                   # each micro-batch's last op so far
    for l, st in enumerate(layers):
        for j in range(m):
            ops += [Op(f"a{l}.{j}", attn, "attention", st.attn, (last[j],) if last[j] else (), group="attention"),
                    Op(f"x{l}.{j}", "a2f", "dispatch", st.a2f, (f"a{l}.{j}",), group="a2f")]
        for j in range(m):
            ops += [Op(f"f{l}.{j}", ffn, "gemm", st.ffn, (f"x{l}.{j}",), group="ffn"),
                    Op(f"y{l}.{j}", "f2a", "combine", st.f2a, (f"f{l}.{j}",), group="f2a")]
            last[j] = f"y{l}.{j}"
    if head:
        ops += [Op(f"head.{j}", attn, "other", head, (last[j],) if last[j] else (), group="head") for j in range(m)]
    return ops


def run(ops: Sequence[Op], comm_sm_share: float = 0.0) -> list[Span]:
    """Schedule ``ops``; compute beside an SM-holding comm op runs on 1 - ``comm_sm_share`` of the SMs."""
    if not 0 <= comm_sm_share < 1:
        raise ValueError(f"comm_sm_share must lie in [0, 1), got {comm_sm_share!r}")
    return schedule(ops, compute_slowdown=1.0 / (1.0 - comm_sm_share))
