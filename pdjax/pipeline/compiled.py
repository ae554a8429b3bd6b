"""What the executor compiles for one stage, as a typed record: the stage's program and
placement, the specs (shape, dtype, sharding) of its inputs and of what passes between its
ops, and the compiled programs of its op kinds and of the overlapped pairs it leads.

:meth:`pdjax.pipeline.Executor.compile` fills one :class:`CompiledStage` per stage (its
forward first, then the backwards whose inputs the forward's outputs fix, then the weight
gradients); the step runner (:mod:`pdjax.pipeline.step_run`) reads them. The compiled
programs themselves are shared between executors that run the same stage program on the same
devices, and a program compiled for one rank is relocated to another that runs the same
program (:mod:`pdjax.pipeline.relocate`); distinct programs compile concurrently
(:func:`compile_all`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from pdjax.compilation import announce
from pdjax.pipeline import relocate
from pdjax.pipeline import stages as st


@dataclasses.dataclass(eq=False)
class CompiledStage:
    """One stage of a compiled schedule.

    ``prog``: its :class:`~pdjax.pipeline.stages.StageProgram`; ``rank``: the placement of
    the rank that runs it; ``chunk``: its layers; ``sp``, ``x``, ``tok``: specs of its params,
    input (tokens or hidden states) and, on the last stage, the target tokens; ``x_arg``:
    ``x`` when the backward needs the input again, else None; ``zeros``: a function making the
    zero gradient accumulator where the params live. Filled by compiling: ``F``, ``B``, ``I``,
    ``W`` (the compiled programs of each kind this process runs), ``res`` and ``gy`` (specs of
    the forward's residuals and of the output gradient), ``carry`` and ``kept`` (what an I
    hands its W, and which of the I's inputs the W reads), ``acc_reshard`` (a program returns
    the accumulator elsewhere than the params: it is moved back), ``pairs`` ((backward stage,
    backward kind) -> (compiled F&B pair led by this stage's forward, whether its outputs must
    be moved to where the standalone programs expect them))."""

    prog: Any
    rank: Any
    chunk: Any
    sp: Any
    x: Any
    tok: Any
    x_arg: Any
    zeros: Callable
    F: Optional[Any] = None
    B: Optional[Any] = None
    I: Optional[Any] = None   # noqa: E741 (the op kind's name)
    W: Optional[Any] = None
    res: Optional[list] = None
    gy: Any = None
    carry: Optional[list] = None
    kept: Optional[list] = None
    acc_reshard: bool = False
    pairs: dict = dataclasses.field(default_factory=dict)


# compiled programs shared by executors (and schedules) that run the same stage program on the
# same devices; weak, so they go when the last executor using them does (every loaded XLA:CPU
# executable holds memory mappings, and a process has a bounded number of those)
_COMPILED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
# abstract key (devices abstracted, see relocate.placement) -> (full key, devices) of a compiled
# program the same program on other devices is relocated from
_TEMPLATES: dict = {}
_COMPILE_LOCK = threading.Lock()
# what compile_all did in this process: XLA compiles, programs relocated from a compiled copy,
# programs found compiled, relocations that failed (then compiled), compiles of a program not
# compiled before on any devices
STATS = {"compiled": 0, "relocated": 0, "reused": 0, "relocate_failed": 0, "distinct": 0}
_NOT_RELOCATABLE: set = set()     # abstract keys whose relocation failed (compiled per device)
_log = logging.getLogger(__name__)


def clear_caches() -> None:
    """Forget the traced stage programs and the shared compiled programs (executors keep
    their own); e.g. between the points of a long sweep."""
    with _COMPILE_LOCK:
        _COMPILED.clear()
        _TEMPLATES.clear()
        _NOT_RELOCATABLE.clear()
    st.clear_caches()


@contextlib.contextmanager
def compiling(what: str):
    """A progress line for a compile that takes seconds (:func:`pdjax.compilation.announce`),
    ending with what was compiled, relocated and found compiled."""
    before = dict(STATS)
    with announce(what) as note:
        yield
        note["done"] = ", ".join(f"{STATS[k] - before[k]} {k}" for k in ("compiled", "relocated", "reused"))


def warm_helpers(ex, info, staged, params) -> None:
    """Run once what a step computes besides its stage programs, so that none of it compiles
    in the first step: the zeros of the gradient accumulators, the loss's seed and sum, and the
    gathering of the per-stage gradients into ``params``' structure and placement (small jnp
    programs, jitted by jax on first use per shape and device)."""
    acc = [i.zeros(sp) for i, sp in zip(info, staged)]
    ones = {i.gy.sharding: jnp.ones((), i.gy.dtype) for i in info if i.chunk.last}
    for sharding, one in ones.items():
        one = jax.device_put(one, sharding)
        jax.block_until_ready(one + one)
    jax.block_until_ready(ex.gather_grads(acc, params))


def compile_threads() -> int:
    """Threads compiling at once: the cores this process may use, or ``PDJAX_COMPILE_THREADS``
    (1: one compile at a time)."""
    env = os.environ.get("PDJAX_COMPILE_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def compile_all(jobs) -> list:
    """The compiled programs of ``(key, jitted, specs)`` jobs, each compiled once per process:
    found in the process-wide cache, else relocated from a compiled copy of the same program
    on other devices (:mod:`pdjax.pipeline.relocate`), else lowered (one at a time: tracing is
    Python) and compiled by XLA, distinct programs concurrently (:func:`compile_threads`).
    Every newly loaded program is run once on zeros (its first run is slow)."""
    jobs = [(compile_key(key, specs), key, jitted, specs) for key, jitted, specs in jobs]
    out = [None] * len(jobs)
    todo: dict = {}                                   # full key -> positions in jobs
    with _COMPILE_LOCK:
        for n, (full, *_) in enumerate(jobs):
            out[n] = _COMPILED.get(full)
            if out[n] is None:
                todo.setdefault(full, []).append(n)
    STATS["reused"] += sum(c is not None for c in out)
    fresh = [jobs[ns[0]] for ns in todo.values()]
    done = _build(fresh)
    for (full, *_), compiled in zip(fresh, done):
        with _COMPILE_LOCK:
            compiled = _COMPILED.setdefault(full, compiled)
        for n in todo[full]:
            out[n] = compiled
    return out


def _build(fresh) -> list:
    """Relocated or compiled programs for jobs with no compiled program yet. Of the jobs
    with the same abstract key (the same program on other devices) one is compiled; when it
    is, the others are relocated from it, or, where that fails, compiled too. Compiles run in
    a pool of threads, the largest programs first."""
    place = [relocate.placement(specs) for *_, specs in fresh]
    abstract = [("unique", n) if pl is None else (key, _shapes(specs), pl[0])
                for n, ((_, key, _, specs), pl) in enumerate(zip(fresh, place))]
    out = [None] * len(fresh)
    groups: dict = {}
    for n in range(len(fresh)):
        out[n] = _relocated(abstract[n], place[n], fresh[n][3])
        if out[n] is None:      # a program known not to relocate is compiled per device at once
            groups.setdefault(("unique", n) if abstract[n] in _NOT_RELOCATABLE else abstract[n], []).append(n)
    with concurrent.futures.ThreadPoolExecutor(compile_threads(), thread_name_prefix="pdjax-compile") as pool:
        pending = {}
        lead = {ns[0]: g for g, ns in groups.items()}
        for n, lowered in _largest_first(list(lead), fresh):
            pending[pool.submit(_compile_one, fresh[n], lowered)] = n
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                n = pending.pop(fut)
                out[n] = fut.result()
                if not out[n].first:
                    continue
                if place[n] is not None and lead[n] == abstract[n]:
                    with _COMPILE_LOCK:
                        _COMPILED[fresh[n][0]] = out[n].compiled
                        _TEMPLATES[abstract[n]] = (fresh[n][0], place[n][1])
                for m in groups[lead[n]][1:]:
                    out[m] = _relocated(abstract[m], place[m], fresh[m][3])
                    if out[m] is None:
                        pending[pool.submit(_compile_one, fresh[m], fresh[m][2].lower(*fresh[m][3]), False)] = m
    return [getattr(c, "compiled", c) for c in out]


class _Done:
    """A program compiled in the pool; ``first``: the first of its abstract key."""

    def __init__(self, compiled, first):
        self.compiled, self.first = compiled, first


def _largest_first(positions, fresh) -> list:
    """``(position, lowered)`` of the jobs at ``positions``, lowered here (tracing is Python,
    one thread) and ordered largest program first (a pool's tail is then short)."""
    lowered = [(n, fresh[n][2].lower(*fresh[n][3])) for n in positions]
    return sorted(lowered, key=lambda nl: -len(nl[1].as_text()))


def _relocated(abstract, place, specs):
    """The program of ``abstract`` relocated to the devices of ``place`` and run once, or
    None (no compiled copy, or the relocation failed)."""
    if place is None:
        return None
    with _COMPILE_LOCK:
        full, template_devices = _TEMPLATES.get(abstract, (None, None))
        template = None if full is None else _COMPILED.get(full)
    if template is None or abstract in _NOT_RELOCATABLE:
        return None
    try:      # the first run checks the program loaded whole (else: compiled)
        compiled = relocate.relocate(template, dict(zip(template_devices, place[1])))
        relocate.run_once(compiled, specs)
    except Exception as exc:  # noqa: BLE001 - jax internals changed, or a program XLA cannot serialize
        _log.debug("pdjax: relocating %s failed (%s): compiling it", abstract[0], exc)
        _NOT_RELOCATABLE.add(abstract)
        STATS["relocate_failed"] += 1
        return None
    STATS["relocated"] += 1
    return compiled


def _compile_one(job, lowered, first=True) -> _Done:
    """Compile a lowered job (XLA compiles without the GIL) and run it once."""
    compiled = lowered.compile()
    STATS["compiled"] += 1
    STATS["distinct"] += first
    relocate.run_once(compiled, job[3])
    return _Done(compiled, first)


def _shapes(specs):
    leaves, treedef = jax.tree.flatten(specs)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def compile_key(key, specs):
    """A compiled program's identity: its key and the structure, shapes, dtypes and shardings
    of its inputs."""
    leaves, treedef = jax.tree.flatten(specs)
    return (key, treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves))
