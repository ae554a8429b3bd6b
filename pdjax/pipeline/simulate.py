"""Timed simulation of a schedule: makespan, per-rank bubbles, activation peaks.

Times are in any unit you like (ms, or multiples of F), the same for every argument.
``F``, ``B`` (full backward), ``W`` (weight-grad part of B; the input-grad part is
``I = B - W``), ``FB`` (an overlapped forward+backward pair, default ``F + B``) and
``comm`` (latency of every cross-rank dependency) are scalars or per-stage sequences.
A pair is costed by its forward's stage; a pair whose backward is an ``I`` costs
``FB - W``. Each rank runs its ops in order, each as soon as its inputs allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .engine import compile_program, run_program
from .ops import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OVERLAP, AnyOp


@dataclass(frozen=True)
class Event:
    """One op's execution: ``rank``, position ``index`` in that rank's program, times."""

    rank: int
    index: int
    op: AnyOp
    start: float
    end: float


@dataclass(frozen=True, eq=False)
class Timeline:
    """Result of :func:`simulate`.

    ``starts[r]`` / ``ends[r]``: arrays of op start/end times on rank ``r``;
    ``bubble[r]``: idle time of rank ``r`` inside ``[0, makespan]``;
    ``peak_activations[r]``: most forward activations alive at once on rank ``r``
    (+1 when an F starts, -1 when its B or I ends; an overlapped pair holds both).
    """

    schedule: object
    costs: dict = field(repr=False)
    starts: tuple = field(repr=False)
    ends: tuple = field(repr=False)
    makespan: float
    busy: np.ndarray
    bubble: np.ndarray
    peak_activations: np.ndarray

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all ranks' time: ``sum(bubble) / (num_ranks * makespan)``."""
        total = self.makespan * len(self.bubble)
        return float(self.bubble.sum() / total) if total > 0 else 0.0

    @cached_property
    def events(self) -> list[Event]:
        """Every op's execution, rank by rank, in program order."""
        out = []
        for r, ops in enumerate(self.schedule.ops):
            st, en = self.starts[r], self.ends[r]
            out.extend(Event(r, i, op, float(st[i]), float(en[i])) for i, op in enumerate(ops))
        return out

    def to_text(self, width: int = 120) -> str:
        """Gantt chart in text: one line per rank, ``.`` for idle time."""
        from .render import timeline_text

        return timeline_text(self, width=width)

    def to_chrome_trace(self, path=None, time_scale_us: float = 1000.0) -> dict:
        """Chrome/Perfetto trace (one thread per rank); times multiplied by
        ``time_scale_us`` to microseconds (default: simulator times are ms)."""
        from .render import chrome_trace

        return chrome_trace(self, path=path, time_scale_us=time_scale_us)

    def _repr_png_(self) -> bytes:
        from .gantt import timeline_png

        return timeline_png(self)

    def _repr_html_(self) -> str:
        return (f"<pre>{self.schedule}: makespan {self.makespan:g}, bubble ratio "
                f"{self.bubble_ratio:.3f}, bubbles per rank {np.round(self.bubble, 6).tolist()}</pre>")


def _per_stage(name: str, value, num_stages: int) -> np.ndarray:
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        arr = np.full(num_stages, float(arr))
    elif arr.shape != (num_stages,):
        raise ValueError(f"{name} must be a scalar or have one entry per stage ({num_stages}), got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        raise ValueError(f"{name} must be finite and >= 0, got {arr[bad[0]]!r} at stage {int(bad[0])}")
    return arr


def stage_costs(num_stages: int, F=1.0, B=2.0, W=0.0, FB=None, comm=0.0) -> dict:
    """Per-stage cost arrays ``F, B, I, W, FB, comm`` (I = B - W; FB defaults to F + B)."""
    costs = {k: _per_stage(k, v, num_stages) for k, v in (("F", F), ("B", B), ("W", W), ("comm", comm))}
    over = np.flatnonzero(costs["W"] > costs["B"])
    if over.size:
        s = int(over[0])
        raise ValueError(f"W ({costs['W'][s]:g}) must not exceed B ({costs['B'][s]:g}) at stage {s}, since I = B - W")
    costs["I"] = costs["B"] - costs["W"]
    costs["FB"] = costs["F"] + costs["B"] if FB is None else _per_stage("FB", FB, num_stages)
    return costs


def simulate(schedule, F=1.0, B=2.0, W=1.0, FB=None, comm=0.0, *, check: bool = True) -> Timeline:
    """Simulate ``schedule`` with as-soon-as-possible list scheduling.

    ``check`` runs the validator first (clear errors for broken schedules); the engine
    itself still reports a deadlock. Cost grows linearly with the number of ops.
    """
    if check:
        schedule.validate()
    c = stage_costs(schedule.num_stages, F=F, B=B, W=W, FB=FB, comm=comm)
    f, b, i_, w, fb = (c[k].tolist() for k in ("F", "B", "I", "W", "FB"))
    table = {FORWARD: f, FULL_BACKWARD: b, BACKWARD_INPUT: i_, BACKWARD_WEIGHT: w}
    durations = []
    for ops in schedule.ops:
        d = []
        for op in ops:
            if op.kind == OVERLAP:
                t = fb[op.forward.stage]
                if op.backward.kind == BACKWARD_INPUT:
                    t = max(t - w[op.backward.stage], 0.0)
                d.append(t)
            else:
                d.append(table[op.kind][op.stage])
        durations.append(d)
    starts, ends = run_program(schedule, compile_program(schedule), durations, c["comm"].tolist())
    starts = tuple(np.asarray(s, dtype=float) for s in starts)
    ends = tuple(np.asarray(e, dtype=float) for e in ends)
    makespan = max((float(e.max()) for e in ends if e.size), default=0.0)
    busy = np.array([float(np.sum(e - s)) for s, e in zip(starts, ends)])
    peaks = np.array([_peak_activations(ops, s, e) for ops, s, e in zip(schedule.ops, starts, ends)], dtype=int)
    return Timeline(schedule, c, starts, ends, makespan, busy, makespan - busy, peaks)


def _peak_activations(ops, starts: np.ndarray, ends: np.ndarray) -> int:
    times, deltas = [], []
    for op, s, e in zip(ops, starts.tolist(), ends.tolist()):
        for part in op.parts:
            if part.kind == FORWARD:
                times.append(s)
                deltas.append(1)
            elif part.kind in (FULL_BACKWARD, BACKWARD_INPUT):
                times.append(e)
                deltas.append(-1)
    if not times:
        return 0
    t, d = np.asarray(times), np.asarray(deltas)
    order = np.lexsort((d, t))  # by time, frees (-1) before allocations (+1)
    return int(max(np.cumsum(d[order]).max(), 0))
