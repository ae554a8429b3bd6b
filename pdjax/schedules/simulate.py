"""Timed simulation of a schedule: makespan, per-rank bubbles, activation and memory peaks.

Times are in any unit you like (ms, or multiples of F), the same for every argument.
``F``, ``B`` (full backward), ``W`` (weight-grad part of B; the input-grad part is
``I = B - W``), ``FB`` (an overlapped forward+backward pair, default ``F + B``) and
``comm`` (latency of every cross-rank dependency) are scalars or per-stage sequences.
A pair is costed by its forward's stage; a pair whose backward is an ``I`` costs
``FB - W``. Each rank runs its ops in order, each as soon as its inputs allow.

Memory (per rank, events at op starts and ends, frees before allocations at equal times):
a forward allocates its micro-batch's activations at its start; they are freed when that
micro-batch's ``B`` ends, or, when the backward is split, when its ``W`` ends (a ``W``
still needs the stage inputs and output gradients). An ``I`` frees nothing in activation
units; the optional byte model (``memory=`` of :func:`simulate`) lets it allocate what it
keeps for the ``W`` and free the forward residuals only it needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .program import compile_program, run_program
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
    (+1 when an F starts, -1 when that micro-batch's B ends, or its W ends when the
    backward is split; an I frees nothing; an overlapped pair holds both its forward's
    new unit and its backward's old one for its whole duration);
    ``peak_memory[r]``: peak of the weighted sum of :func:`simulate`'s ``memory`` model
    on rank ``r`` (floats; equals ``peak_activations`` when no model is given);
    ``memory``: that model's per-stage arrays ``F``, ``I``, ``I_free``.
    """

    schedule: object
    costs: dict = field(repr=False)
    starts: tuple = field(repr=False)
    ends: tuple = field(repr=False)
    makespan: float
    busy: np.ndarray
    bubble: np.ndarray
    peak_activations: np.ndarray
    peak_memory: np.ndarray
    memory: dict = field(repr=False, default=None)

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
        from .gantt import timeline_html

        return timeline_html(self)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """A notebook's display: the Gantt chart, as PNG and as HTML under the summary line
        (frontends prefer HTML), drawn once."""
        from .gantt import timeline_bundle

        return timeline_bundle(self)


def _per_stage(name: str, value, num_stages: int, unit: str = "stage", positive: bool = False) -> np.ndarray:
    """``value`` (a scalar or one entry per ``unit``) as a float array [num_stages], finite
    and >= 0 (> 0 if ``positive``), or a ValueError naming ``name`` and the offending entry."""
    arr = np.asarray(value)
    if isinstance(value, (str, bytes)) or arr.dtype.kind not in "iuf":   # no parsing, no bools
        raise TypeError(f"{name} must be a number or one number per {unit}, got {value!r}")
    arr = arr.astype(float)
    if arr.ndim == 0:
        arr = np.full(num_stages, float(arr))
    elif arr.shape != (num_stages,):
        raise ValueError(f"{name} must be a scalar or have one entry per {unit} ({num_stages}), got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0 if positive else arr < 0))
    if bad.size:
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {float(arr[bad[0]])!r} "
                         f"at {unit} {int(bad[0])}")
    return arr


def stage_costs(num_stages: int, F=1.0, B=2.0, W=0.0, FB=None, comm=0.0, *, I=None, FI=None) -> dict:
    """Per-stage cost arrays ``F, B, I, W, FB, FI, comm``.

    ``I`` defaults to ``B - W`` (then ``W <= B`` is required); give it to cost input-grad ops
    on their own (e.g. measured). ``FB`` (an overlapped pair with a full backward) defaults
    to ``F + B``; ``FI`` (a pair whose backward is an ``I``, costed by its forward's stage)
    defaults to ``FB - W`` of the pair's backward stage, so it is only filled in when given.
    """
    costs = {k: _per_stage(k, v, num_stages, positive=k == "F") for k, v in
             (("F", F), ("B", B), ("W", W), ("comm", comm))}
    if I is None:
        over = np.flatnonzero(costs["W"] > costs["B"])
        if over.size:
            s = int(over[0])
            raise ValueError(f"W ({costs['W'][s]:g}) must not exceed B ({costs['B'][s]:g}) at stage {s}, "
                             f"since I = B - W")
        costs["I"] = costs["B"] - costs["W"]
    else:
        costs["I"] = _per_stage("I", I, num_stages)
    costs["FB"] = costs["F"] + costs["B"] if FB is None else _per_stage("FB", FB, num_stages)
    if FI is not None:
        costs["FI"] = _per_stage("FI", FI, num_stages)
    return costs


MEMORY_KEYS = ("F", "I", "I_free")


def memory_model(num_stages: int, memory=None) -> dict:
    """Per-stage arrays ``F, I, I_free`` of a memory model (see :func:`simulate`).

    ``memory`` maps some of ``"F"`` (default 1), ``"I"`` (default 0) and ``"I_free"``
    (default 0) to a scalar or one value per stage, finite and >= 0, with
    ``I_free <= F`` on every stage. ``None`` gives activation units (F=1, I=I_free=0).
    """
    if memory is None:
        memory = {}
    if not isinstance(memory, Mapping):
        raise TypeError(f"memory must be a mapping with keys {list(MEMORY_KEYS)}, got {type(memory).__name__}")
    unknown = [k for k in memory if k not in MEMORY_KEYS]
    if unknown:
        raise ValueError(f"unknown memory key {unknown[0]!r}; known: {list(MEMORY_KEYS)}")
    defaults = {"F": 1.0, "I": 0.0, "I_free": 0.0}
    out = {k: _per_stage(f"memory[{k!r}]", memory.get(k, defaults[k]), num_stages) for k in MEMORY_KEYS}
    over = np.flatnonzero(out["I_free"] > out["F"])
    if over.size:
        s = int(over[0])
        raise ValueError(f"memory['I_free'] ({out['I_free'][s]:g}) must not exceed memory['F'] "
                         f"({out['F'][s]:g}) at stage {s}: an I frees only part of what the F allocated")
    return out


def simulate(schedule, F=1.0, B=2.0, W=1.0, FB=None, comm=0.0, *, I=None, FI=None, memory=None,
             check: bool = True) -> Timeline:
    """Simulate ``schedule`` with as-soon-as-possible list scheduling.

    ``memory`` (optional) is a per-stage memory model, e.g. bytes: a mapping with keys
    (each a scalar or one value per stage, finite, >= 0; missing keys take the default)

    - ``"F"`` (default 1): allocated by a forward at its start, held until that
      micro-batch's B ends, or until its W ends when the backward is split;
    - ``"I"`` (default 0): allocated by an input-grad op at its start (what it keeps for
      the W, e.g. intermediate cotangents), held until the W ends;
    - ``"I_free"`` (default 0, at most ``"F"``): freed by an I at its end (the forward
      residuals only the I needed).

    So a W frees ``F + I - I_free`` at its end and a B frees ``F``; an overlapped pair
    allocates its parts' amounts at its start and frees them at its end. Per rank, the
    events are sorted by time, frees before allocations at equal times, and
    ``Timeline.peak_memory`` is the peak of their cumulative sum (never below 0).

    ``I`` and ``FI`` (optional, see :func:`stage_costs`) cost input-grad ops and pairs with an
    input-grad backward on their own, e.g. with durations measured by the executor.

    ``check`` runs the validator first (clear errors for broken schedules); the engine
    itself still reports a deadlock. Cost grows linearly with the number of ops.
    """
    if not hasattr(schedule, "ops") or not hasattr(schedule, "layout"):
        raise TypeError(f"schedule must be a Schedule (pdjax.pipeline.build, Schedule.from_csv), "
                        f"got {type(schedule).__name__}")
    if check:
        schedule.validate()
    c = stage_costs(schedule.num_stages, F=F, B=B, W=W, FB=FB, comm=comm, I=I, FI=FI)
    mem = memory_model(schedule.num_stages, memory)
    f, b, i_, w, fb = (c[k].tolist() for k in ("F", "B", "I", "W", "FB"))
    fi = c["FI"].tolist() if "FI" in c else None
    table = {FORWARD: f, FULL_BACKWARD: b, BACKWARD_INPUT: i_, BACKWARD_WEIGHT: w}
    durations = []
    for ops in schedule.ops:
        d = []
        for op in ops:
            if op.kind == OVERLAP:
                t = fb[op.forward.stage]
                if op.backward.kind == BACKWARD_INPUT:
                    t = fi[op.forward.stage] if fi is not None else max(t - w[op.backward.stage], 0.0)
                d.append(t)
            else:
                d.append(table[op.kind][op.stage])
        durations.append(d)
    starts, ends = run_program(schedule, compile_program(schedule), durations, c["comm"].tolist())
    starts = tuple(np.asarray(s, dtype=float) for s in starts)
    ends = tuple(np.asarray(e, dtype=float) for e in ends)
    makespan = max((float(e.max()) for e in ends if e.size), default=0.0)
    busy = np.array([float(np.sum(e - s)) for s, e in zip(starts, ends)])
    peaks = _all_peaks(schedule, starts, ends, mem)
    peak_units = np.array([p[0] for p in peaks], dtype=int)
    peak_memory = np.array([p[1] for p in peaks], dtype=float)
    return Timeline(schedule, c, starts, ends, makespan, busy, makespan - busy, peak_units, peak_memory, mem)


def _all_peaks(schedule, starts, ends, mem) -> list[tuple[int, float]]:
    # signed amount of each event code (rows, see _memory_peaks) per stage (columns)
    amounts = np.stack([mem["F"], mem["I"], -mem["I_free"], -(mem["F"] + mem["I"] - mem["I_free"]), -mem["F"]])
    return [_memory_peaks(ops, s, e, amounts) for ops, s, e in zip(schedule.ops, starts, ends)]


# event codes: allocations at an op's start, frees at its end
_F_ALLOC, _I_ALLOC, _I_FREE, _W_FREE, _B_FREE = range(5)
_UNITS = np.array([1, 0, 0, -1, -1])  # activation units per event code (an I frees none)
_START_CODE = {FORWARD: _F_ALLOC, BACKWARD_INPUT: _I_ALLOC}
_END_CODE = {BACKWARD_INPUT: _I_FREE, BACKWARD_WEIGHT: _W_FREE, FULL_BACKWARD: _B_FREE}


def _memory_peaks(ops, starts: np.ndarray, ends: np.ndarray, amounts: np.ndarray) -> tuple[int, float]:
    """One rank's ``(peak activation units, peak of the weighted model)``.

    ``amounts[code, stage]``: signed amount of an event. Events are sorted by time,
    frees before allocations at equal times (stable, so program order otherwise).
    """
    times, codes, stages = [], [], []
    add_t, add_c, add_s = times.append, codes.append, stages.append
    start_code, end_code = _START_CODE, _END_CODE
    for op, s, e in zip(ops, starts.tolist(), ends.tolist()):
        for part in op.parts:
            kind = part.kind
            if kind in start_code:
                add_t(s)
                add_c(start_code[kind])
                add_s(part.stage)
            if kind in end_code:
                add_t(e)
                add_c(end_code[kind])
                add_s(part.stage)
    if not times:
        return 0, 0.0
    t, code, stage = np.asarray(times, dtype=float), np.asarray(codes), np.asarray(stages)
    alloc = code < _I_FREE
    order = np.lexsort((alloc, t))  # by time, frees (False) before allocations (True)
    code, stage = code[order], stage[order]
    units = int(max(np.cumsum(_UNITS[code]).max(), 0))
    weighted = float(max(np.cumsum(amounts[code, stage]).max(), 0.0))
    return units, weighted


def measured_timeline(schedule, starts, ends, *, memory=None, costs=None) -> Timeline:
    """A :class:`Timeline` of measured per-op ``starts[r][i]`` / ``ends[r][i]`` (e.g. from
    :class:`pdjax.pipeline.Executor`), with the same makespan, bubble and memory-peak
    accounting as :func:`simulate` (the memory model as there; ``costs``: the per-stage
    costs it was measured with, if any), so measured and simulated runs plot and compare alike."""
    if len(starts) != schedule.num_ranks or len(ends) != schedule.num_ranks:
        raise ValueError(f"need one start and end array per rank ({schedule.num_ranks})")
    starts = tuple(np.asarray(s, dtype=float) for s in starts)
    ends = tuple(np.asarray(e, dtype=float) for e in ends)
    for r, (ops, s, e) in enumerate(zip(schedule.ops, starts, ends)):
        if s.shape != (len(ops),) or e.shape != (len(ops),):
            raise ValueError(f"rank {r}: {len(ops)} ops but {s.shape[0]} starts and {e.shape[0]} ends")
        if np.any(e < s):
            raise ValueError(f"rank {r}: an op ends before it starts")
    mem = memory_model(schedule.num_stages, memory)
    makespan = max((float(e.max()) for e in ends if e.size), default=0.0)
    busy = np.array([float(np.sum(e - s)) for s, e in zip(starts, ends)])
    peaks = _all_peaks(schedule, starts, ends, mem)
    return Timeline(schedule, dict(costs or {}), starts, ends, makespan, busy, makespan - busy,
                    np.array([p[0] for p in peaks], dtype=int), np.array([p[1] for p in peaks], dtype=float), mem)
