"""A run directory's life: made fresh under ``runs/<name>/``, marked ``RUNNING`` while the
experiment runs, and either complete (the marker gone, ``metrics.json`` and ``report.md``
written) or marked ``FAILED``: a file holding the error and its traceback. A process killed
mid-run leaves ``RUNNING`` behind. :func:`check_complete` reads the markers, so ``pdjax
report`` says a run failed (or never finished) instead of reading half a directory."""

from __future__ import annotations

import contextlib
import datetime
import os
import traceback

RUNNING, FAILED = "RUNNING", "FAILED"


class RunFailed(RuntimeError):
    """An experiment that failed after its run directory was made (``run_dir``, now marked
    ``FAILED``), or a run directory so marked. The error is the ``__cause__``."""

    def __init__(self, run_dir: str, message: str):
        super().__init__(message)
        self.run_dir = run_dir


def new(runs_dir: str, name: str) -> str:
    """A fresh ``<runs_dir>/<name>/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when taken)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = os.path.join(runs_dir, name, stamp)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for n in range(1, 1000):
        candidate = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {os.path.dirname(base)}")


@contextlib.contextmanager
def running(run_dir: str):
    """Mark ``run_dir`` ``RUNNING`` for the block; on an exception mark it ``FAILED`` (the
    error and its traceback) and raise :class:`RunFailed` from it (``KeyboardInterrupt`` and
    the like are marked and go on as they are)."""
    _write(os.path.join(run_dir, RUNNING), f"pid {os.getpid()}, started {datetime.datetime.now().isoformat()}\n")
    try:
        yield
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        _write(os.path.join(run_dir, FAILED), error + "\n\n" + traceback.format_exc())
        os.remove(os.path.join(run_dir, RUNNING))
        if not isinstance(e, Exception):
            raise
        raise RunFailed(run_dir, f"the run failed ({error}); {run_dir} is marked {FAILED}, "
                                 f"the traceback is in {os.path.join(run_dir, FAILED)}") from e
    os.remove(os.path.join(run_dir, RUNNING))


def check_complete(run_dir: str) -> None:
    """Raise :class:`RunFailed` when ``run_dir`` is marked ``FAILED`` or still ``RUNNING``."""
    failed = os.path.join(run_dir, FAILED)
    if os.path.exists(failed):
        with open(failed) as f:
            error = f.readline().strip()
        raise RunFailed(run_dir, f"{run_dir}: the run failed ({error}); the traceback is in {failed}")
    if os.path.exists(os.path.join(run_dir, RUNNING)):
        raise RunFailed(run_dir, f"{run_dir}: the run has not finished (it is still running, or its process "
                                 f"was killed; see {os.path.join(run_dir, RUNNING)})")


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
