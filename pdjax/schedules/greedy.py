"""A memory-capped greedy list scheduler over any layout, and the zero-bubble family:
ZB-H2 (``zbh2``) and ZB-V (``zbv``); V-Half and V-Min are in :mod:`.vblock`.

:func:`greedy_schedule` builds a schedule op by op, as a simulation: each rank, when it
is free, starts the highest-priority op whose inputs have arrived and which fits its
memory cap; the op that can start earliest over all ranks is committed first, so no
later decision can make an input arrive earlier (list scheduling, the same timing rule
as :func:`~pdjax.schedules.simulate`). Backwards are always split into an input-grad ``I``
and a weight-grad ``W``; ``W`` ops wait in a per-rank queue and run, oldest first, when
the policy says so (``w_lag``) or when nothing else is ready (they fill bubbles). Per
stage, forwards and input-grad backwards run in micro-batch order.

Memory follows the simulator's W-aware model (``simulate(memory=...)``): an ``F``
allocates ``mem_F`` at its start, an ``I`` allocates ``mem_I`` at its start and frees
``mem_I_free`` at its end, a ``W`` frees the rest at its end. An op starts only if the
rank's memory after its allocation stays within ``cap`` (ops on a rank run one after
another, so the memory at a start is the sum over the ops already run).

ZB-V (``zbv``) is the paper's hand-made phase pattern (see :func:`zbv`). ZB-H2 runs the
scheduler with unit costs ``F = I = W = 1``, no comm, and a memory cap of ``2P - 1``
micro-batch activations per rank (2x 1F1B's ``P``), its published memory; the published
claim is zero bubble when F = I = W.

"Zero bubble" is about the steady state the papers measure: every rank busy from its
first op to its last (:func:`span_bubble` = 0), with the first ops of the ranks offset by
the forward's fill; a single isolated step still has that fill and drain in its makespan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdjax.arguments import check_int

from .greedy_run import GreedyRun
from .layout import Layout
from .ops import Op
from .schedule import Schedule


@dataclass(frozen=True)
class Policy:
    """Choices of the greedy scheduler.

    ``forward_first``: when a forward and an input-grad backward are both ready, run the
    forward (fill the pipeline) instead of the backward (free memory sooner).
    ``w_lag``: run a W as soon as more than ``w_lag`` are queued (0: W right after its I,
    a full backward; ``None``: only when nothing else can run). ``deep_first``: on a rank
    with several stages, prefer the stage later in its pipeline. ``overlap``: run a ready
    forward and a ready backward of another stage as one overlapped pair (cost ``FB``).
    """

    forward_first: bool = False
    w_lag: int | None = None
    deep_first: bool = True
    overlap: bool = False

    def label(self) -> str:
        w = "lazyW" if self.w_lag is None else f"W{self.w_lag}"
        return (f"{'F' if self.forward_first else 'I'}first-{w}-{'deep' if self.deep_first else 'shallow'}"
                + ("-pairs" if self.overlap else ""))


def _stage_array(value, num_stages: int, name: str) -> list[float]:
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        arr = np.full(num_stages, float(arr))
    if arr.shape != (num_stages,) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite, >= 0, a scalar or one value per stage ({num_stages})")
    return arr.tolist()


def greedy_schedule(layout: Layout, *, F=1.0, I=1.0, W=1.0, FB=None, comm=0.0, cap=math.inf,
                    mem_F=1.0, mem_I=0.0, mem_I_free=0.0, policy: Policy = Policy(),
                    name: str = "greedy") -> Schedule | None:
    """Greedy schedule of ``layout`` (see module docstring); ``None`` when the memory cap
    ``cap`` (a scalar or one value per rank) lets no rank make progress.

    Costs and memory amounts are scalars or one value per stage; ``comm`` is added to every
    dependency between stages on different ranks. ``FB`` (default ``F + I + W``) is the cost
    of an overlapped pair, used only with ``policy.overlap`` (a pair with an I costs
    ``FB - W``). The returned schedule's ``options`` record the policy and cap.
    """
    S, R = layout.num_stages, layout.num_ranks
    f, i_, w = (_stage_array(v, S, n) for v, n in ((F, "F"), (I, "I"), (W, "W")))
    fb = [a + b + c for a, b, c in zip(f, i_, w)] if FB is None else _stage_array(FB, S, "FB")
    cm = _stage_array(comm, S, "comm")
    mf, mi, mif = (_stage_array(v, S, n) for v, n in ((mem_F, "mem_F"), (mem_I, "mem_I"),
                                                         (mem_I_free, "mem_I_free")))
    caps = np.broadcast_to(np.asarray(cap, dtype=float), (R,)).tolist()
    run = GreedyRun(layout, (f, i_, w, fb, cm), (mf, mi, mif), caps, policy)
    ops = run.run()
    if ops is None:
        return None
    return Schedule(name, layout, tuple(tuple(o) for o in ops),
                    (("policy", policy.label()), ("cap", tuple(caps)), ("cap_binding", run.binding)))


def span_bubble(timeline) -> np.ndarray:
    """Per rank, idle time between its first op's start and its last op's end: the
    bubble of the zero-bubble papers' steady state (consecutive steps tile without the
    fill and drain when it is 0 on every rank and all spans are equal)."""
    out = []
    for s, e, b in zip(timeline.starts, timeline.ends, timeline.busy):
        out.append(float(e.max() - s.min() - b) if s.size else 0.0)
    return np.array(out)


def _named(name: str, layout: Layout, cap: float) -> Schedule:
    s = greedy_schedule(layout, cap=cap, policy=Policy(), name=name)
    if s is None:  # pragma: no cover - the caps below always leave room to progress
        raise AssertionError(f"{name}: the greedy scheduler made no progress")
    return Schedule(name, layout, s.ops, (("cap", cap),))


def zbh2(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H2: one stage per rank, backward split into I and W, up to ``2P - 1`` micro-batch
    activations per rank (2x 1F1B's ``P``): more warm-up forwards fill the bubble before
    the first backward and W ops fill the drain."""
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    return _named("zbh2", Layout.chain(range(p), m, num_ranks=p), 2 * p - 1)


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V, the zero-bubble paper's hand-made V schedule (arXiv 2401.10241, section 6).

    ``2P`` stages in a V: rank ``r`` holds ``down = r`` and ``up = 2P-1-r``, each half a
    rank's layers; backwards split into I and W. With unit op times (``F = I = W``, no
    comm) rank ``r`` can start at slot ``r`` and every rank stays busy to its last op.
    Rank ``r``'s program, in phases:

    1. warm-up: micro-batch 0 comes back up the V to ``up`` at slot ``2P-1-r``, so
       ``2(P-r) - 1`` forwards of ``down`` fill the slots before it;
    2. ``r`` pairs (F ``up``, F ``down``): the up-leg forwards arrive every second slot
       while rank ``r+1`` interleaves its own;
    3. ``P - r`` triples (F, I, W of ``up``): the first backwards start at the V's end;
    4. steady state, 1F-1I-1W on each stage in turn: (F, I, W of ``down``), (F, I, W of
       ``up``) until every forward ran;
    5. cool-down: ``r`` pairs (I ``down``, I ``up``) with their W deferred, ``P - r`` pairs
       (I ``down``, W ``down``), then the deferred W's of ``up`` and of ``down``: rank
       ``r``'s last I comes ``r`` slots after rank 0's, and its W's fill the wait.

    Phase counts assume ``m >= 2P - 1`` micro-batches; with fewer, the ops of the missing
    ones are left out (the program keeps its order; the simulator then shows the bubble).
    Peak: ``2P`` stage activations per rank (= ``P`` full stages, 1F1B's). See
    ``tests/pipeline/test_pipeline_zero_bubble.py`` for the claims checked by simulation.
    """
    p = check_int("num_ranks", num_ranks, 1)
    m = check_int("num_microbatches", num_microbatches, 1)
    n = max(m, 2 * p - 1)   # phase counts of a long enough step; ops of mb >= m dropped
    programs = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        count = {(k, s): 0 for k in "FIW" for s in (down, up)}
        prog: list[Op] = []

        def emit(*ops: tuple[str, int]) -> None:
            for kind, stage in ops:
                mb = count[(kind, stage)]
                count[(kind, stage)] = mb + 1
                if mb < m:
                    prog.append(Op(kind, stage, mb))

        emit(*[("F", down)] * (2 * (p - r) - 1))
        for _ in range(r):
            emit(("F", up), ("F", down))
        for _ in range(p - r):
            emit(("F", up), ("I", up), ("W", up))
        while count[("F", down)] < n or count[("F", up)] < count[("F", down)]:
            if count[("F", down)] < n:
                emit(("F", down))
            emit(("I", down), ("W", down), ("F", up), ("I", up), ("W", up))
        for _ in range(r):
            emit(("I", down), ("I", up))
        for _ in range(p - r):
            emit(("I", down), ("W", down))
        emit(*[("W", up)] * (count[("I", up)] - count[("W", up)]))
        emit(*[("W", down)] * (count[("I", down)] - count[("W", down)]))
        programs.append(tuple(prog))
    return Schedule("zbv", Layout.v_shape(p, m), tuple(programs))
