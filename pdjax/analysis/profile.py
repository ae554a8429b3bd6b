"""A PyTorch-profiler capture (Chrome trace JSON) read as a timeline of :class:`~pdjax.analysis.streams.Span`.

    prof = read_profile("train.json")        # a path, or the trace already loaded (a dict or a bare list)
    prof.op_times()                          # {"gemm": s, "attention": s, "dispatch": s, "combine": s, "other": s}
    prof.makespan_s, prof.overlap_s          # seconds
    prof.chunk_times()["F"], prof.group_times()[("attn(B)", 2)]

Made for DeepSeek's published profiles (deepseek-ai/profile-data: ``train.json`` is one
DualPipe overlapped forward & backward chunk pair of 4 MoE layers of DeepSeek-V3), read with
the rules below; any trace of the same format reads.

**Kernels.** Every event with ``ph == "X"`` and ``cat`` one of :data:`KERNEL_CATEGORIES`
(``ts`` and ``dur`` in microseconds) is one :class:`Span`: ``stream`` is its ``tid`` (the CUDA
stream id) as a string (``"pid:tid"`` when the trace holds kernels of several GPUs),
``start_s`` / ``end_s`` are seconds from the first kernel's start, ``label`` is the kernel name.

**Op class.** Decided by the kernel, never by the annotation around it (a ``combine(B)``
region launches a dispatch kernel): the first row of :data:`KERNEL_RULES` whose pattern is
found in the kernel name (``re.search``) gives the class; no row: ``other``.

* DeepEP kernels (namespace ``dpsk::ep`` or ``deep_ep``) with ``dispatch`` in the name are
  ``dispatch`` (``notify_dispatch`` and ``get_dispatch_layout`` included), with ``combine``
  ``combine``. A ``cached_notify`` kernel prepares the next DeepEP kernel of its stream: it
  takes the class of the next dispatch or combine kernel on that stream (the previous one if
  none follows, ``other`` if the stream runs neither); ``cached_notify_dispatch`` /
  ``cached_notify_combine`` (intranode) say which by name.
* Utilities in a GEMM namespace (``dpsk::grouped_gemm::cuda::utils::transpose``,
  ``fill_tensormaps_kernel``) are ``other``.
* ``attention``: FlashAttention (``flash::`` forward ``compute_attn_ws``, ``FlashAttnBwd``
  and its pre/post-processing kernels) and FlashMLA (``mla``) kernels.
* ``gemm``: names with ``gemm`` (cuBLAS ``sm90_xmma_gemm_...``, CUTLASS / DeepGEMM
  ``...::GemmKernel``) and cuBLAS's ``nvjet_...`` kernels.
* ``other``: the rest (FP8 casts, transposes, norms, RoPE, elementwise, memcpy, memset),
  wherever it runs (a cast on the communication stream is ``other``).

**Streams.** A stream is a communication stream (:attr:`Profile.comm_streams`) if it runs a
``dispatch`` or ``combine`` kernel; every other stream is a compute stream.

**Annotations.** A kernel's group is the ``user_annotation`` region its launch was made in:
its ``args.correlation`` names the launch (a ``cuda_runtime`` or ``cuda_driver`` event), and
the group is the innermost annotation of the launching CPU thread whose ``[ts, ts + dur]``
holds the launch's ``ts``. Autograd runs backward on threads of its own, which the main
thread's annotations do not cover: a launch that no annotation of its thread holds takes the
shortest annotation of another thread of the same process that holds it. Wrappers name no
kernel: ``ProfilerStep#N`` and every annotation that contains another annotation of its
thread (``1F1B`` around the layers). A kernel without a launch or an annotation has group "".
Annotations of one thread nest (as the profiler records them). The n-th occurrence (in time
order, from 0) of an annotation name is ``(name, n)``: with one annotation per layer, n is the
layer. Its chunk is the letter in parentheses at the end of its name (``attn(F)``: "F").
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections import Counter, defaultdict
from decimal import Decimal
from typing import NamedTuple

from pdjax.analysis.profile_plot import plot_profile  # noqa: F401 (re-exported: profile.plot_profile)
from pdjax.analysis.streams import Span, busy_time, class_times, makespan
from pdjax.arguments import ArgumentTypeError

KERNEL_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
ANNOTATION_CATEGORY = "user_annotation"
PROFILER_STEP = re.compile(r"ProfilerStep#\d+")
CHUNK = re.compile(r"\((\w+)\)\s*$")
NEXT_DEEPEP = "class of the next DeepEP kernel on its stream"

_DEEPEP = r"(?:dpsk::ep|deep_ep)::[\w:]*"      # a DeepEP kernel's qualified name, up to its template arguments
# (pattern searched in the kernel name, op class): the first row that matches decides; no row: "other"
KERNEL_RULES = (
    (_DEEPEP + r"cached_notify_dispatch", "dispatch"),
    (_DEEPEP + r"cached_notify_combine", "combine"),
    (_DEEPEP + r"cached_notify\b", NEXT_DEEPEP),
    (_DEEPEP + r"dispatch", "dispatch"),
    (_DEEPEP + r"combine", "combine"),
    (r"gemm::[\w:]*utils::|fill_tensormaps", "other"),
    (r"(?i)flash|\bmla|_mla", "attention"),
    (r"(?i)gemm|^nvjet", "gemm"),
)
_RULES = tuple((re.compile(pattern), op_class) for pattern, op_class in KERNEL_RULES)
_MICROSECOND = Decimal("1e-6")


def kernel_class(name: str) -> str:
    """The op class of a kernel called ``name`` by :data:`KERNEL_RULES` (``other`` if no row
    matches), or :data:`NEXT_DEEPEP` for a ``cached_notify`` kernel."""
    for pattern, op_class in _RULES:
        if pattern.search(name):
            return op_class
    return "other"


class Profile:
    """The kernels of a trace as :class:`Span` (``spans``, in start order; times in seconds
    from the first kernel's start), with the annotation occurrence each belongs to. Made by
    :func:`read_profile`; see the module docstring for the rules."""

    def __init__(self, spans, occurrences, annotations):
        self.spans = list(spans)
        self._occurrences = list(occurrences)    # per span: (annotation name, occurrence index), or ("", 0)
        self._annotations = list(annotations)    # every (name, index) in time order

    def __repr__(self) -> str:
        return (f"Profile({len(self.spans)} kernels on streams {list(self.streams)}, makespan "
                f"{self.makespan_s * 1e3:.3f} ms, kernel time {self.total_kernel_s * 1e3:.3f} ms)")

    @property
    def makespan_s(self) -> float:
        """First kernel start to last kernel end, seconds."""
        return makespan(self.spans)

    @property
    def total_kernel_s(self) -> float:
        """Summed durations of all kernels on all streams, seconds (what :meth:`op_times` splits)."""
        return sum(s.duration_s for s in self.spans)

    def op_times(self) -> dict:
        """{op class: summed kernel durations in seconds, all streams}, every class present."""
        return class_times(self.spans)

    @property
    def streams(self) -> tuple:
        """The streams that run kernels, in numeric order of their ids."""
        return tuple(sorted({s.stream for s in self.spans}, key=_stream_order))

    @property
    def comm_streams(self) -> tuple:
        """The streams that run a ``dispatch`` or ``combine`` kernel."""
        comm = {s.stream for s in self.spans if s.op_class in ("dispatch", "combine")}
        return tuple(s for s in self.streams if s in comm)

    @property
    def compute_streams(self) -> tuple:
        """Every stream that is not a communication stream."""
        return tuple(s for s in self.streams if s not in self.comm_streams)

    def stream_busy(self) -> dict:
        """{stream: seconds during which it runs a kernel (the union of its kernels)}."""
        return {st: busy_time(s for s in self.spans if s.stream == st) for st in self.streams}

    @property
    def overlap_s(self) -> float:
        """Seconds during which some compute stream and some communication stream both run a kernel."""
        comm = set(self.comm_streams)
        compute = [s for s in self.spans if s.stream not in comm]
        communication = [s for s in self.spans if s.stream in comm]
        # |compute & comm| = |compute| + |comm| - |compute | comm|, each a union of intervals
        return busy_time(compute) + busy_time(communication) - busy_time(self.spans)

    def group_spans(self) -> dict:
        """{(annotation name, occurrence index): [Span]} for every annotation occurrence in
        time order (an occurrence without kernels: []), then ``("", 0)``: the kernels of no
        annotation, if any."""
        out = {key: [] for key in self._annotations}
        for span, key in zip(self.spans, self._occurrences):
            out.setdefault(key, []).append(span)
        return out

    def group_times(self) -> dict:
        """{(annotation name, occurrence index): {op class: seconds}} (see :meth:`group_spans`)."""
        return {key: class_times(spans) for key, spans in self.group_spans().items()}

    def chunk_times(self) -> dict:
        """{chunk: {op class: seconds}} by the letter in parentheses ending the annotation's
        name ("F", "B", "W"; "" for kernels of no annotation or of a name without one); "F",
        "B", "W" and "" are always present."""
        by_chunk = {chunk: [] for chunk in ("F", "B", "W", "")}
        for span in self.spans:
            by_chunk.setdefault(chunk_of(span.group), []).append(span)
        return {chunk: class_times(spans) for chunk, spans in by_chunk.items()}


def chunk_of(annotation: str) -> str:
    """The letters in parentheses ending ``annotation`` ("attn(F)": "F"), or ""."""
    match = CHUNK.search(annotation)
    return match.group(1) if match else ""


def read_profile(source) -> Profile:
    """The :class:`Profile` of a PyTorch-profiler trace: ``source`` is a path to its JSON, or
    the trace already loaded (``{"traceEvents": [...], ...}`` or the bare event list).
    ValueError, before any work, for a path that is not a file or not JSON, a dict without
    ``traceEvents``, no kernel events, or a kernel without a numeric ``ts`` or ``dur`` or
    with a negative ``dur``; TypeError for a ``source`` of another type."""
    events = _events(source)
    kernels = _kernel_events(events)
    launches = {e["args"]["correlation"]: e for e in events if _is_launch(e)}
    index = _AnnotationIndex(events)
    t0 = min(_time(k["ts"]) for k in kernels)
    several_gpus = len({k.get("pid") for k in kernels}) > 1
    spans, occurrences = [], []
    for k in kernels:
        start = _time(k["ts"]) - t0
        stream = f"{k.get('pid')}:{k.get('tid')}" if several_gpus else str(k.get("tid"))
        launch = launches.get((k.get("args") or {}).get("correlation"))
        key = index.group(launch) if launch is not None else ("", 0)
        spans.append([stream, kernel_class(k["name"]), float(start * _MICROSECOND),
                      float((start + _time(k["dur"])) * _MICROSECOND), k["name"], key[0]])
        occurrences.append(key)
    _attribute_notify(spans)
    return Profile([Span(*s) for s in spans], occurrences, index.occurrences)


def _events(source) -> list:
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise ValueError(f"read_profile: {str(source)!r} is not a file")
        try:
            with open(source, encoding="utf-8") as f:
                source = json.load(f, parse_float=Decimal)   # keeps the nanoseconds of "ts": 1740461679471346.123
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"read_profile: {str(source)!r} is not JSON ({err})") from None
    if isinstance(source, dict):
        if "traceEvents" not in source:
            raise ValueError(f"read_profile: the trace has no 'traceEvents' (keys: {sorted(source)[:10]})")
        source = source["traceEvents"]
    elif not isinstance(source, list):
        raise ArgumentTypeError("read_profile: expected a path, a trace dict or a list of events, "
                                f"got {type(source).__name__}")
    if not isinstance(source, list):
        raise ValueError(f"read_profile: 'traceEvents' must be a list, got {type(source).__name__}")
    return [e for e in source if isinstance(e, dict)]


def _kernel_events(events) -> list:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES]
    if not kernels:
        raise ValueError(f"read_profile: the trace has no kernel events (ph 'X', cat in {KERNEL_CATEGORIES})")
    for k in kernels:
        name = k.get("name")
        if not isinstance(name, str):
            raise ValueError(f"read_profile: a kernel event has no name: {k!r}")
        for field in ("ts", "dur"):
            if not _is_number(k.get(field)):
                raise ValueError(f"read_profile: kernel {name!r} has no numeric {field!r} (got {k.get(field)!r})")
        if k["dur"] < 0:
            raise ValueError(f"read_profile: kernel {name!r} has a negative dur ({k['dur']!r} us)")
    return sorted(kernels, key=lambda k: (_time(k["ts"]), str(k.get("pid")), str(k.get("tid"))))


def _is_number(value) -> bool:
    return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool) and Decimal(value).is_finite()


def _time(value) -> Decimal:
    """A trace time (microseconds) as an exact Decimal (float or int in, no rounding)."""
    return Decimal(value)


def _is_launch(event) -> bool:
    return (event.get("cat") in LAUNCH_CATEGORIES and _is_number(event.get("ts"))
            and isinstance(event.get("args"), dict) and "correlation" in event["args"])


def _attribute_notify(spans) -> None:
    """Give each ``cached_notify`` span (a list [stream, class, ...], in start order) the
    class of the next dispatch / combine span on its stream (else the previous one, else other)."""
    by_stream = defaultdict(list)
    for s in spans:
        by_stream[s[0]].append(s)
    for stream_spans in by_stream.values():
        deepep = [i for i, s in enumerate(stream_spans) if s[1] in ("dispatch", "combine")]
        for i, s in enumerate(stream_spans):
            if s[1] == NEXT_DEEPEP:
                j = bisect.bisect_right(deepep, i)
                if j < len(deepep):
                    s[1] = stream_spans[deepep[j]][1]
                else:
                    s[1] = stream_spans[deepep[-1]][1] if deepep else "other"


class _Annotation(NamedTuple):
    start: Decimal       # microseconds
    end: Decimal
    key: tuple           # (name, occurrence index)


class _AnnotationIndex:
    """The non-wrapper annotations of each CPU thread, for finding the one a launch was made in."""

    def __init__(self, events):
        by_thread = defaultdict(list)
        for e in events:
            if (e.get("cat") == ANNOTATION_CATEGORY and e.get("ph") == "X" and isinstance(e.get("name"), str)
                    and _is_number(e.get("ts")) and _is_number(e.get("dur"))):
                by_thread[(e.get("pid"), e.get("tid"))].append((_time(e["ts"]), _time(e["ts"]) + _time(e["dur"]),
                                                                e["name"]))
        kept = sorted(((start, end, name, thread) for thread, anns in by_thread.items()
                       for start, end, name in _without_wrappers(anns)), key=lambda a: (a[0], a[1], a[2]))
        seen = Counter()
        self.occurrences = []                   # (name, index) of every kept annotation, in time order
        self.threads = defaultdict(list)        # (pid, tid) -> [_Annotation] in start order
        for start, end, name, thread in kept:
            key = (name, seen[name])
            seen[name] += 1
            self.occurrences.append(key)
            self.threads[thread].append(_Annotation(start, end, key))
        self.starts = {thread: [a.start for a in anns] for thread, anns in self.threads.items()}

    def group(self, launch) -> tuple:
        """(name, index) of the annotation ``launch`` was made in (module docstring), or ("", 0)."""
        pid, tid, ts = launch.get("pid"), launch.get("tid"), _time(launch["ts"])
        own = self._holding((pid, tid), ts)
        if own is not None:
            return own.key
        holding = (self._holding(thread, ts) for thread in self.threads if thread[0] == pid)
        others = [a for a in holding if a is not None]
        return min(others, key=lambda a: a.end - a.start).key if others else ("", 0)

    def _holding(self, thread, ts):
        i = bisect.bisect_right(self.starts.get(thread, []), ts) - 1
        return self.threads[thread][i] if i >= 0 and self.threads[thread][i].end >= ts else None


def _without_wrappers(annotations) -> list:
    """``annotations`` ((start, end, name) of one thread) less the wrappers: ProfilerStep#N and
    every annotation that contains another one."""
    ordered = sorted(annotations, key=lambda a: (a[0], -a[1]))
    wrapper, stack = set(), []
    for i, (_, end, _) in enumerate(ordered):
        while stack and ordered[stack[-1]][1] < end:     # starts no later, ends earlier: does not contain it
            stack.pop()
        if stack:
            wrapper.add(stack[-1])
        stack.append(i)
    return [a for i, a in enumerate(ordered) if i not in wrapper and not PROFILER_STEP.fullmatch(a[2])]


def _stream_order(stream: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in stream.split(":"))
