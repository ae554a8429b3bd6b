"""A proven lower bound on the makespan of any schedule of a layout.

The argument (a one-machine relaxation, as for job shops). Micro-batches of one pipeline
are interchangeable, so count ops instead of naming them: on stage ``s`` the ``k``-th
forward to run (0-based, in time order) cannot end before

    eF(s, k) = max(eF(prev(s), k) + c, eF(s, k - 1)) + F(s)

since it needs ``k + 1`` distinct micro-batches whose forward on ``prev(s)`` ended (and
``c`` = comm when ``prev(s)`` is on another rank); likewise the ``k``-th input-grad
backward ``eI(s, k) = max(eI(next(s), k) + c, eF(s, k), eI(s, k - 1)) + I(s)`` and the
``k``-th weight-grad ``eW(s, k) = max(eI(s, k), eW(s, k - 1)) + W(s)``. Mirrored, the
``k``-th op from the end of each kind leaves at least a tail ``q`` of work that must
follow it (its own backward chain down to the first stage, the remaining ops of its
kind on the stage). Ops of a rank run one at a time, so each rank is a single machine
whose jobs have release times ``eX - X``, durations and tails ``q``; the optimum of that
one-machine problem *with preemption* (Jackson's rule: always run the released job with
the longest tail) is a lower bound on its non-preemptive optimum, hence on the makespan.
The bound is the largest over ranks. It ignores memory (so it holds for any budget).

A full ``B`` is an ``I`` then a ``W`` back to back, so the bound covers schedules with or
without the split. An overlapped pair costing ``FB < F + B`` saves at most ``F + B - FB``
per forward, so forwards count as ``min(F, FB - B)`` (at least 0) here.
"""

from __future__ import annotations

import heapq

import numpy as np

from .layout import Layout


def _eff(costs: dict) -> tuple[list, list, list]:
    f = np.asarray(costs["F"], dtype=float)
    i_ = np.asarray(costs["I"], dtype=float)
    w = np.asarray(costs["W"], dtype=float)
    if "FB" in costs and costs["FB"] is not None:
        b = i_ + w
        f = np.clip(np.minimum(f, np.asarray(costs["FB"], dtype=float) - b), 0.0, None)
    return f.tolist(), i_.tolist(), w.tolist()


def lower_bound(layout: Layout, costs: dict) -> float:
    """Lower bound on the makespan of every valid schedule of ``layout``.

    ``costs``: per-stage arrays ``F``, ``I``, ``W``, ``comm`` (and optionally ``FB``), as
    :func:`pdjax.schedules.stage_costs` returns them.
    """
    f, i_, w = _eff(costs)
    comm = np.asarray(costs["comm"], dtype=float).tolist()
    sr = layout.stage_rank

    def c(a: int, b: int) -> float:   # latency from stage a to stage b
        return comm[a] if sr[a] != sr[b] else 0.0

    heads = {}
    tails = {}
    for pipe in layout.pipelines:
        eF, eI, eW = _heads(layout, pipe, f, i_, w, c)
        qF, qI, qW = _tails(layout, pipe, f, i_, w, c)
        for s in pipe.stages:
            heads[s] = (eF[s], eI[s], eW[s])
            tails[s] = (qF[s], qI[s], qW[s])
    best = 0.0
    for r in range(layout.num_ranks):
        jobs = []   # (release, duration, tail)
        for s in layout.stages_on_rank(r):
            for kind, d in enumerate((f[s], i_[s], w[s])):
                e, q = heads[s][kind], tails[s][kind]
                m = len(e)
                jobs.extend((e[k] - d, d, q[m - 1 - k]) for k in range(m))
        best = max(best, _jackson_preemptive(jobs))
    return best


def _heads(layout: Layout, pipe, f: list, i_: list, w: list, c) -> tuple[dict, dict, dict]:
    """Per stage of ``pipe``, the earliest ends ``eF, eI, eW`` of its ``k``-th forward,
    input-grad and weight-grad (module docstring); ``c(a, b)`` the latency from a to b."""
    prev, nxt = layout.prev_stage, layout.next_stage
    m = pipe.num_microbatches
    st = pipe.stages
    eF = {s: [0.0] * m for s in st}
    eI = {s: [0.0] * m for s in st}
    eW = {s: [0.0] * m for s in st}
    for s in st:
        for k in range(m):
            t = eF[s][k - 1] if k else 0.0
            if prev[s] >= 0:
                t = max(t, eF[prev[s]][k] + c(prev[s], s))
            eF[s][k] = t + f[s]
    for s in reversed(st):
        for k in range(m):
            t = max(eF[s][k], eI[s][k - 1] if k else 0.0)
            if nxt[s] >= 0:
                t = max(t, eI[nxt[s]][k] + c(nxt[s], s))
            eI[s][k] = t + i_[s]
            eW[s][k] = max(eI[s][k], eW[s][k - 1] if k else 0.0) + w[s]
    return eF, eI, eW


def _tails(layout: Layout, pipe, f: list, i_: list, w: list, c) -> tuple[dict, dict, dict]:
    """Per stage of ``pipe``, the tails ``qF, qI, qW``, ``k`` counted from the end: the least
    time after the op's end (its backward chain, the remaining ops of its kind)."""
    prev, nxt = layout.prev_stage, layout.next_stage
    m = pipe.num_microbatches
    st = pipe.stages
    qW = {s: [w[s] * k for k in range(m)] for s in st}
    qI = {s: [0.0] * m for s in st}
    qF = {s: [0.0] * m for s in st}
    for s in st:   # backward tails run down the chain: prev stages first
        for k in range(m):
            t = max(w[s] + qW[s][k], (qI[s][k - 1] + i_[s]) if k else 0.0)
            if prev[s] >= 0:
                t = max(t, c(s, prev[s]) + i_[prev[s]] + qI[prev[s]][k])
            qI[s][k] = t
    for s in reversed(st):
        for k in range(m):
            t = max(i_[s] + qI[s][k], (qF[s][k - 1] + f[s]) if k else 0.0)
            if nxt[s] >= 0:
                t = max(t, c(s, nxt[s]) + f[nxt[s]] + qF[nxt[s]][k])
            qF[s][k] = t
    return qF, qI, qW


def _jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Optimal ``max(completion + tail)`` of one machine with release times, preemption
    allowed: at every moment run the released job with the largest tail."""
    jobs = sorted(jobs)
    heap: list = []   # (-tail, remaining)
    t, i, n, best = 0.0, 0, len(jobs), 0.0
    while i < n or heap:
        if not heap and t < jobs[i][0]:
            t = jobs[i][0]
        while i < n and jobs[i][0] <= t:
            heapq.heappush(heap, (-jobs[i][2], jobs[i][1]))
            i += 1
        neg_q, rem = heapq.heappop(heap)
        nxt_release = jobs[i][0] if i < n else float("inf")
        run = min(rem, nxt_release - t)
        t += run
        if rem - run > 1e-12:
            heapq.heappush(heap, (neg_q, rem - run))
        else:
            best = max(best, t - neg_q)
    return best
