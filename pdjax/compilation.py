"""Compiling for users: a persistent compilation cache by default, and a progress line for
compiles that take seconds. Loads no jax itself (``import pdjax`` stays light).

The cache: ``import pdjax`` points jax's persistent compilation cache at
``$XDG_CACHE_HOME/pdjax/jax`` (default ``~/.cache/pdjax/jax``), so a second run of the same
programs loads them instead of compiling. It is set only where nothing else is: not when the
environment sets ``JAX_COMPILATION_CACHE_DIR`` (it then wins, as does a later
``jax.config.update("jax_compilation_cache_dir", ...)``), not when jax was imported first and
its ``jax_compilation_cache_dir`` is set. Opt out with ``PDJAX_NO_COMPILATION_CACHE=1`` before
``import pdjax``, or :func:`disable_default_cache` before the first compile. Before jax is
imported the default goes through the environment variable (jax reads it when it starts), so
child processes (a pipeline's rank processes) share it; ``PDJAX_DEFAULT_COMPILATION_CACHE_DIR``
marks it as pdjax's default, not the user's, so that :func:`disable_default_cache` (or
``PDJAX_NO_COMPILATION_CACHE=1``) in a child turns it off there too. jax writes only
programs that took over ``jax_persistent_cache_min_compile_time_secs`` (1 s) to compile;
on XLA:CPU a program holding the ``TopK`` call ``jax.lax.top_k`` becomes cannot be
serialized and is compiled every run (pdjax's MoE routing uses the sort-free :func:`pdjax.model.topk.top_k`).

The progress line: :func:`announce` prints ``pdjax: compiling <what>...`` to stderr once a
compile has taken ``progress_after_s`` seconds, and its duration when it ends; nothing for a
quick one. ``PDJAX_COMPILE_PROGRESS=0`` (or ``progress_after_s = None``) turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

OPT_OUT = "PDJAX_NO_COMPILATION_CACHE"
_ENV = "JAX_COMPILATION_CACHE_DIR"
_MARK = "PDJAX_DEFAULT_COMPILATION_CACHE_DIR"   # the default this module put in _ENV, for child processes
_set_by_us: str | None = None   # the directory this module chose (None: it chose none)

progress_after_s: float | None = None if os.environ.get("PDJAX_COMPILE_PROGRESS", "1") == "0" else 1.5


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/pdjax/jax``, or ``~/.cache/pdjax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pdjax", "jax")


def enable_default_cache() -> str | None:
    """Point jax's persistent compilation cache at :func:`default_cache_dir` unless the user
    chose a cache directory or opted out (``PDJAX_NO_COMPILATION_CACHE``); returns the
    directory set (or inherited from a parent process's pdjax), or None. Run by ``import pdjax``."""
    global _set_by_us
    inherited = os.environ.get(_ENV) or None
    if inherited is not None and inherited == os.environ.get(_MARK):    # a parent pdjax process's default
        _set_by_us = inherited
    if os.environ.get(OPT_OUT, "") not in ("", "0"):
        disable_default_cache()
        return None
    if os.environ.get(_ENV):
        return _set_by_us
    path = default_cache_dir()
    if "jax" in sys.modules:
        import jax

        if jax.config.jax_compilation_cache_dir:
            return None
        jax.config.update("jax_compilation_cache_dir", path)
    else:
        os.environ[_ENV] = os.environ[_MARK] = path
    _set_by_us = path
    return path


def disable_default_cache() -> None:
    """Undo :func:`enable_default_cache` (a directory the user set is left alone), before or
    after jax is imported, in this process and the child processes it starts later. Call it
    before the first compile: jax decides whether to use the cache once."""
    global _set_by_us
    if _set_by_us is None:
        return
    if os.environ.get(_ENV) == _set_by_us:
        del os.environ[_ENV]
    if os.environ.get(_MARK) == _set_by_us:
        del os.environ[_MARK]
    if "jax" in sys.modules:
        import jax

        if jax.config.jax_compilation_cache_dir == _set_by_us:
            jax.config.update("jax_compilation_cache_dir", None)
    _set_by_us = None


@contextlib.contextmanager
def announce(what: str, stream=None):
    """Around a compile: after ``progress_after_s`` seconds print ``pdjax: compiling
    <what>...`` (stderr), and at the end its duration; a quicker compile prints nothing.
    Yields a dict whose ``"done"`` entry, if set, is printed with the duration."""
    after = progress_after_s
    note: dict = {}
    if after is None:
        yield note
        return
    out = stream if stream is not None else sys.stderr
    shown = threading.Event()

    def show():
        print(f"pdjax: compiling {what}...", end="", file=out, flush=True)
        shown.set()

    timer = threading.Timer(after, show)
    timer.daemon = True
    t0 = time.perf_counter()
    timer.start()
    try:
        yield note
    finally:
        timer.cancel()
        timer.join()          # a cancelled timer ends at once; one showing its line finishes it
        if shown.is_set():
            extra = f" ({note['done']})" if note.get("done") else ""
            print(f" {time.perf_counter() - t0:.1f} s{extra}", file=out, flush=True)
