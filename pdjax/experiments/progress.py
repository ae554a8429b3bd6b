"""Progress bars for the long loops experiments drive (sweeps, simulations, engine runs,
training steps), drawn with rich on stderr, never into results.

Bars show only inside :func:`bars` (``pdjax run`` opens it unless ``--quiet``); elsewhere,
e.g. when a test or a notebook calls an experiment function directly, :func:`track`,
:func:`counter` and :func:`note` do nothing visible::

    with bars(enabled=True):
        for rate in track(rates, "rates"):
            ...
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Iterable, Iterator, Optional

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pdjax_progress", default=None)


@contextlib.contextmanager
def bars(enabled: bool = True, stream=None):
    """Within this block, :func:`track` and :func:`counter` draw bars on ``stream``
    (default: the current ``sys.stderr``); with ``enabled=False`` they stay silent."""
    if not enabled:
        token = _ACTIVE.set(None)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    console = Console(file=stream if stream is not None else sys.stderr)
    # descriptions are plain text: no markup ("[x]" kept) and no emoji codes (":B:" in "F:B:W" is no emoji)
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        token = _ACTIVE.set(progress)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def track(items: Iterable, description: str, total: Optional[int] = None) -> Iterator:
    """Iterate ``items``, advancing a bar labelled ``description`` after each one."""
    progress = _ACTIVE.get()
    if progress is None:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    task = progress.add_task(description, total=total)
    for item in items:
        yield item
        progress.advance(task)


@contextlib.contextmanager
def counter(description: str, total: Optional[int] = None):
    """A bar for work whose steps the caller counts: yields ``advance()`` (no total: a running
    count, e.g. the simulations of a bisection search)."""
    progress = _ACTIVE.get()
    if progress is None:
        yield lambda: None
        return
    task = progress.add_task(description, total=total)
    yield lambda: progress.advance(task)
    done = next(t.completed for t in progress.tasks if t.id == task)
    progress.update(task, total=done)


def counted(fn, advance):
    """``fn`` calling ``advance()`` after each call (to count a search's simulations)."""
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        advance()
        return out
    return wrapped


def note(text: str) -> None:
    """A line above the bars (on their stream); nothing outside :func:`bars`."""
    progress = _ACTIVE.get()
    if progress is not None:
        progress.console.print(text, markup=False, highlight=False)
