"""A lock shared by the processes of one machine: ``flock`` on one file. Isolated op timing
holds it around each op, so that ops of different processes never share the machine's
cores (processes on other hosts do not share them anyway)."""

from __future__ import annotations

import fcntl
import os


class MachineLock:
    """``acquire()`` / ``release()`` of an exclusive ``flock`` on ``path`` (created if
    needed); every process that opens the same path shares the lock."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
