"""Kernels on GPU streams: the one timeline type that measured traces and predictions share,
and the scheduler that turns a program of ops on streams into such a timeline: the one
overlap model of pdjax (every micro-batch schedule of pdjax.analysis, dual-batch overlap in
pdjax.parallel.dbo, AF ping-pong in pdjax.sim.afd_step).

A :class:`Span` is one kernel (measured) or one op (predicted): its stream, its op class,
its start and end in seconds. Op classes are decided by what runs, not by the code around
it (:data:`OP_CLASSES`):

* ``gemm``: dense and grouped matrix multiplications;
* ``attention``: attention kernels with their pre- and post-processing;
* ``indexer``: DeepSeek-V3.2's lightning indexer (its logits and top-k; its projections are GEMMs);
* ``dispatch`` / ``combine``: the expert all-to-all, with their notify and layout kernels;
* ``other``: everything else (casts, transposes, norms, RoPE, elementwise).

:func:`schedule` runs a program: each :class:`Op` names its stream, its duration and the ops
it waits for; ops on one stream run one at a time in program order (a CUDA stream, or any
resource that serves one op at a time), and an op starts when its stream is free and
everything it waits for has ended. The streams are :data:`RESOURCES`: a GPU's compute and
communication streams (:data:`STREAMS`, the default pair) and an AF unit's attention side,
FFN side and the two directions of its exchange (:data:`AFD_STREAMS`, the names of
pdjax.disagg.afd_engine's measured spans). The set is closed, so a misspelt stream is refused
rather than run as a resource of its own beside the others.

While a communication op that occupies SMs runs, GEMMs on the "compute" stream (and only
there) run slower by ``compute_slowdown`` (DeepEP's normal kernels hold 20 of an H800's 132
SMs: DeepGEMM's persistent kernels beside them run on 112). Other compute kernels share the SMs dynamically and are not
slowed (their measured times, from DeepSeek's overlapped trace, already include it).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

from pdjax.arguments import check_nonnegative

OP_CLASSES = ("gemm", "attention", "indexer", "dispatch", "combine", "other")
STREAMS = ("compute", "comm")
AFD_STREAMS = ("attention", "a2f", "ffn", "f2a")
RESOURCES = STREAMS + AFD_STREAMS


@dataclasses.dataclass(frozen=True)
class Span:
    """One kernel or op on a stream: ``stream`` (a name: one of :data:`RESOURCES`, or a
    trace's stream id as a string), ``op_class`` (one of :data:`OP_CLASSES`), ``start_s`` and
    ``end_s`` (seconds from the timeline's origin), ``label`` (kernel or op name) and
    ``group`` (the chunk or layer it belongs to, e.g. "attn(F)"; "" if unknown)."""

    stream: str
    op_class: str
    start_s: float
    end_s: float
    label: str = ""
    group: str = ""

    def __post_init__(self):
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"Span.op_class must be one of {OP_CLASSES}, got {self.op_class!r}")
        if not self.end_s >= self.start_s:
            raise ValueError(f"Span {self.label!r} ends ({self.end_s!r}) before it starts ({self.start_s!r})")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def class_times(spans: Iterable[Span]) -> dict:
    """{op class: summed duration in seconds} over ``spans``, every class present (0.0)."""
    out = dict.fromkeys(OP_CLASSES, 0.0)
    for s in spans:
        out[s.op_class] += s.duration_s
    return out


def busy_time(spans: Iterable[Span]) -> float:
    """Seconds during which at least one of ``spans`` runs (the union of their intervals)."""
    total, cur_start, cur_end = 0.0, None, None
    for s in sorted(spans, key=lambda s: s.start_s):
        if cur_end is None or s.start_s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s.start_s, s.end_s
        else:
            cur_end = max(cur_end, s.end_s)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def makespan(spans: Sequence[Span]) -> float:
    """First start to last end, seconds (0 for no spans)."""
    if not spans:
        return 0.0
    return max(s.end_s for s in spans) - min(s.start_s for s in spans)


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a program: ``name`` (unique), ``stream`` (one of :data:`RESOURCES`),
    ``op_class``, ``duration_s`` (alone on the GPU), ``after`` (names of the ops it waits
    for), ``holds_sms`` (an op that occupies SMs, slowing the GEMMs on "compute" beside it)."""

    name: str
    stream: str
    op_class: str
    duration_s: float
    after: tuple = ()
    holds_sms: bool = False
    group: str = ""

    def __post_init__(self):
        if self.stream not in RESOURCES:
            raise ValueError(f"Op {self.name!r}: stream must be one of {RESOURCES}, got {self.stream!r}")
        if self.op_class not in OP_CLASSES:
            raise ValueError(f"Op {self.name!r}: op_class must be one of {OP_CLASSES}, got {self.op_class!r}")
        check_nonnegative(f"Op {self.name!r} duration_s", self.duration_s)
        object.__setattr__(self, "after", tuple(self.after))


def schedule(ops: Sequence[Op], compute_slowdown: float = 1.0) -> list[Span]:
    """The timeline of ``ops`` (see the module docstring): a list of :class:`Span` in
    program order. Each stream runs its ops in program order, one at a time; an op starts
    when its stream is free and every op in its ``after`` has ended. A GEMM on "compute"
    runs at ``1 / compute_slowdown`` of its speed while a ``holds_sms`` op runs on another
    stream. ValueError for a repeated name or a dependency that is not an earlier op."""
    if not compute_slowdown >= 1:
        raise ValueError(f"compute_slowdown must be >= 1, got {compute_slowdown!r}")
    _check_program(ops)
    queues = {s: [i for i, op in enumerate(ops) if op.stream == s] for s in RESOURCES}
    queues = {s: q for s, q in queues.items() if q}
    head = dict.fromkeys(queues, 0)
    running: dict = {}                       # stream -> [op index, start, work left]
    end: dict = {}
    spans: list[Optional[Span]] = [None] * len(ops)
    t = 0.0
    while True:
        _start_ready(ops, queues, head, running, end, spans, t)
        if not running:
            break
        rate = _rates(ops, running, compute_slowdown)
        dt = min(left / rate[s] for s, (_, _, left) in running.items())
        t += dt
        for s in list(running):
            i, t0, left = running[s]
            left -= dt * rate[s]
            if left <= 1e-15 * max(1.0, ops[i].duration_s):
                end[ops[i].name] = t
                spans[i] = _span(ops[i], t0, t)
                del running[s]
            else:
                running[s][2] = left
    if any(sp is None for sp in spans):                  # pragma: no cover - deps are checked above
        raise RuntimeError("schedule left ops unplaced")
    return spans


def _check_program(ops: Sequence[Op]) -> None:
    seen = set()
    for op in ops:
        if op.name in seen:
            raise ValueError(f"op name {op.name!r} appears twice in the program")
        for dep in op.after:
            if dep not in seen:
                raise ValueError(f"op {op.name!r} waits for {dep!r}, which is not an earlier op")
        seen.add(op.name)


def _start_ready(ops, queues, head, running, end, spans, t) -> None:
    """Start, at time ``t``, every op whose stream is free and whose inputs have ended; an op
    of no duration ends at once, which may free an op on a stream already looked at: so
    look again until nothing more starts."""
    again = True
    while again:
        again = False
        for s, queue in queues.items():
            while s not in running and head[s] < len(queue):
                i = queue[head[s]]
                if any(d not in end for d in ops[i].after):
                    break
                head[s] += 1
                if ops[i].duration_s == 0:
                    end[ops[i].name] = t
                    spans[i] = _span(ops[i], t, t)
                    again = True
                else:
                    running[s] = [i, t, ops[i].duration_s]


def _rates(ops, running, compute_slowdown) -> dict:
    """{stream: speed} of the running ops: a GEMM on "compute" beside an SM-holding op runs slower."""
    comp = running.get("compute")
    slowed = (comp is not None and ops[comp[0]].op_class == "gemm"
              and any(ops[i].holds_sms for s, (i, _, _) in running.items() if s != "compute"))
    return {s: 1.0 / compute_slowdown if s == "compute" and slowed else 1.0 for s in running}


def _span(op: Op, start: float, end: float) -> Span:
    stream = op.stream
    return Span(stream, op.op_class, start, end, op.name, op.group)
