"""What the executor compiles for one stage, as a typed record: the stage's program and
placement, the specs (shape, dtype, sharding) of its inputs and of what passes between its
ops, and the compiled programs of its op kinds and of the overlapped pairs it leads.

:meth:`pdjax.pipeline.Executor.compile` fills one :class:`CompiledStage` per stage (its
forward first, then the backwards whose inputs the forward's outputs fix, then the weight
gradients); the step runner (:mod:`pdjax.pipeline.runtime`) reads them. The compiled
programs themselves are shared between executors that run the same stage program on the same
devices (:func:`compile_all`)."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Optional

import jax

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
_COMPILE_LOCK = threading.Lock()


def clear_caches() -> None:
    """Forget the traced stage programs and the shared compiled programs (executors keep
    their own); e.g. between the points of a long sweep."""
    with _COMPILE_LOCK:
        _COMPILED.clear()
    st.clear_caches()


def compile_all(jobs) -> list:
    """Compile ``(key, jitted, specs)`` jobs, each once per process (one thread: concurrent
    XLA:CPU compiles of these programs aborted the process in a test run)."""
    out = []
    for key, jitted, specs in jobs:
        full_key = compile_key(key, specs)
        with _COMPILE_LOCK:
            hit = _COMPILED.get(full_key)
        if hit is None:
            hit = jitted.lower(*specs).compile()
            with _COMPILE_LOCK:
                hit = _COMPILED.setdefault(full_key, hit)
        out.append(hit)
    return out


def compile_key(key, specs):
    """A compiled program's identity: its key and the structure, shapes, dtypes and shardings
    of its inputs."""
    leaves, treedef = jax.tree.flatten(specs)
    return (key, treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves))
