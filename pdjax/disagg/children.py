"""Kept for :mod:`pdjax.pipeline.processes` until its rank processes move onto
:class:`pdjax.cluster.supervisor.Supervisor` (which already serves the PD servers): the
child-side helpers now live in :mod:`pdjax.cluster.supervisor`."""

from __future__ import annotations

from pdjax.cluster.supervisor import device_environ as child_env
from pdjax.cluster.supervisor import exit_when_orphaned

__all__ = ["child_env", "exit_when_orphaned", "file_tail"]


def file_tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of a (log) file; "" when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""
