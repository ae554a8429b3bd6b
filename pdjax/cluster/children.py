"""One supervised child process (:class:`Child`, what :class:`~pdjax.cluster.supervisor.Supervisor`
starts): its Popen in a process group of its own and a thread reading its output into a
bounded tail; :func:`describe_exit` (how a process ended, in words), :func:`process_state`
(its state letter in ``/proc``: ``T`` stopped, ``Z`` zombie, ...) and
:func:`die_with_parent_argv` (a command run so that Linux SIGKILLs it when its parent dies,
however it ends).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Optional

# Run first in a child that is to die with its parent (``python -I -S -c`` this, then the
# parent's pid, the executable, the argv): PR_SET_PDEATHSIG, then exec. In a process of its own
# rather than a Popen ``preexec_fn``: that runs Python in a fork of a threaded parent (jax's
# threads), which can deadlock before the exec.
ORPHAN_PIPE_ENV = "PDJAX_ORPHAN_PIPE"   # "1": this process's stdin is its supervisor's orphan pipe
PIN_CORES_ENV = "PDJAX_PIN_CORES"       # read (and removed) by the wrapper: the cores the command runs on

DIE_WITH_PARENT = """import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    sys.exit(f"pdjax: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):                 # the parent died before prctl ran
    os.kill(os.getpid(), signal.SIGKILL)
cores = os.environ.pop("PDJAX_PIN_CORES", "")        # before the exec: every thread inherits it
if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
try:
    os.execv(sys.argv[2], sys.argv[3:])
except OSError as e:
    sys.exit(f"pdjax: cannot run {sys.argv[3]!r}: {e.strerror}")
"""


def resolve_executable(command: str, env: Optional[dict] = None) -> str:
    """The file ``command`` runs, as Popen finds it (on ``env``'s PATH, or this process's,
    unless it has a ``/``); OSError (ENOENT, EACCES) naming it if there is none."""
    if os.sep in command:
        if not os.path.exists(command):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
        if os.path.isdir(command) or not os.access(command, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), command)
        return command
    found = shutil.which(command, path=(os.environ if env is None else env).get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
    return found


def die_with_parent_argv(argv, env: Optional[dict] = None) -> list:
    """``argv`` run so that Linux SIGKILLs it when this process dies, however it ends
    (``PR_SET_PDEATHSIG``, set by :data:`DIE_WITH_PARENT` before it execs the command: the
    pid is the command's); ``argv`` itself off Linux. It holds for the command, not for
    processes the command starts. Linux sends the signal when the *thread* that started the
    child ends: start from a thread that outlives the child (the main thread)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid()),
            resolve_executable(argv[0], env), *argv]


def process_state(pid: int) -> Optional[str]:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R`` running, ``S``
    sleeping, ``T`` stopped, ``t`` stopped by a tracer, ``Z`` zombie, ...); None if it is
    gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What :meth:`Supervisor.start` was given (kept for ``restart``)."""
    argv: tuple
    env: Optional[dict]
    name: str
    prefix: Optional[str]
    orphan_pipe: bool
    log_path: Optional[str]
    die_with_parent: bool = False


class Child:
    """One started process: its Popen and the thread reading its output."""

    def __init__(self, spec: ProcessSpec, stream, tail_lines: int, keep: tuple):
        self.spec, self.keep = spec, keep
        self.tail: collections.deque = collections.deque(maxlen=tail_lines)
        self.kept: list = []                       # lines starting with a ``keep`` prefix, never dropped
        self.eof = False
        self.changed = threading.Condition()
        argv = die_with_parent_argv(spec.argv, spec.env) if spec.die_with_parent else list(spec.argv)
        env = spec.env
        if spec.orphan_pipe:                       # tells exit_when_orphaned its stdin is this pipe
            env = {**(os.environ if env is None else env), ORPHAN_PIPE_ENV: "1"}
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.PIPE if spec.orphan_pipe else subprocess.DEVNULL,
                                      env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True,
                                       name=f"pdjax-supervisor-{spec.name}")
        self.reader.start()

    def _read(self, stream) -> None:
        log = open(self.spec.log_path, "a", errors="replace") if self.spec.log_path else None
        try:
            for raw in self.popen.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                with self.changed:
                    self.tail.append(line)
                    if line.startswith(self.keep):
                        self.kept.append(line)
                    self.changed.notify_all()
                if stream is not None:
                    stream.write(f"{self.spec.prefix} {line}\n" if self.spec.prefix else f"{line}\n")
                    stream.flush()
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
        finally:
            if log is not None:
                log.close()
            with self.changed:
                self.eof = True
                self.changed.notify_all()

    def kill(self) -> None:
        """SIGKILL its whole process group (it and anything it started), if it still runs."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def reap(self, timeout: float = 30.0) -> None:
        """Wait (up to ``timeout`` s) for it to end, then close its pipes; bounded: an output
        pipe still held open (a process outside its group, or it still running) is left to the
        reading thread, whose blocked read holds the pipe's lock (closing it would hang)."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        self.reader.join(timeout=2)
        if not self.reader.is_alive():
            self.popen.stdout.close()

    def tail_text(self, lines: Optional[int] = None) -> str:
        if self.popen.poll() is not None:
            self.reader.join(timeout=2)
        with self.changed:
            out = list(self.tail)
        return "\n".join(out if lines is None else out[-lines:])


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by signal SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
