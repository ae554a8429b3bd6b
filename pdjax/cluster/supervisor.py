"""One process supervisor for every multi-process path of pdjax: the cluster launcher
(:func:`pdjax.cluster.launch`), the PD servers' prefill and decode processes, the pipeline's
rank processes.

A :class:`Supervisor` starts processes, each with its own argv and environment, each in a
process group of its own (``start_new_session``). A thread per process reads its output
(stdout and stderr together) line by line into a bounded tail, optionally streams it with a
prefix (``[i] ...``) and appends it to a log file. Nothing blocks but the waits the caller
asks for:

- ``wait_for_line(i, prefix, timeout)`` / ``wait_ready(i, timeout)``: readiness from a line
  the child prints (:func:`announce_ready` prints ``PDJAX_READY {json}``);
  ``wait_until(i, ready, timeout)`` for any other sign (a ready file);
- ``poll()`` / ``exited()`` / ``check()``: :class:`LaunchError` naming the process that died
  (its exit code or signal and its last lines); ``stopped()``: those alive but stopped
  (SIGSTOP, a debugger), blamed by ``wait_all`` when a peer then dies (a cluster's heartbeat
  aborts the healthy processes);
- ``kill(i)`` (SIGKILL to its group: jax catches SIGTERM), ``restart(i)`` (same argv and
  environment, same index), ``close()`` (SIGKILL to every group, wait for each: no process is
  left behind); ``start(..., die_with_parent=True)``: Linux SIGKILLs the process when this
  one dies, however it ends (SIGKILL included, where ``close()`` never runs).

Child side: :func:`announce_ready`, :func:`exit_when_orphaned` (with ``orphan_pipe=True`` the
child's stdin is a pipe from the supervisor; the child exits when it closes, i.e. when the
supervising process is gone however it ended), :func:`device_environ`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from pdjax.cluster.children import ORPHAN_PIPE_ENV, Child, ProcessSpec, describe_exit, process_state

READY = "PDJAX_READY"


class LaunchError(RuntimeError):
    """A supervised process failed: ``process`` (its index, None for a timeout of the whole
    launch), ``returncode`` (None if it was still running), ``tail`` (its last output lines)."""

    def __init__(self, message: str, process: Optional[int], returncode: Optional[int], tail: str):
        super().__init__(message)
        self.process, self.returncode, self.tail = process, returncode, tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


JAX_SETTINGS = ("jax_default_matmul_precision", "jax_compilation_cache_dir",
                "jax_persistent_cache_min_compile_time_secs")


def jax_settings_environ() -> dict:
    """This process's jax numerics and compilation cache (:data:`JAX_SETTINGS` that are set),
    as the environment variables a child jax process reads them from."""
    import jax

    return {name.upper(): str(value) for name in JAX_SETTINGS if (value := getattr(jax.config, name, None)) is not None}


PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")     # what device_environ's platform may be


def device_environ(device_count: int, extra: dict | None = None, platform: str = "cpu") -> dict:
    """The environment of a child jax process: this one's, on ``platform`` (one of
    :data:`PLATFORMS`; on "cpu" with ``device_count`` simulated devices; other platforms: set
    the visible devices in ``extra``, e.g. ``CUDA_VISIBLE_DEVICES``), this process's jax
    settings (:func:`jax_settings_environ`, once jax is imported here; before that they are
    only in the environment, which the child inherits), unbuffered output, the pdjax this
    process runs importable (a checkout that is not installed), then ``extra``. Every
    process pdjax starts gets its environment from here."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    env = dict(os.environ)
    if "jax" in sys.modules:
        env.update(jax_settings_environ())
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={device_count}"])
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


# ---- child side ------------------------------------------------------------------------------
def announce_ready(info: dict, prefix: str = READY) -> None:
    """Child side: print the ready line (``prefix`` then ``info`` as JSON, e.g. the ports the
    OS picked) that :meth:`Supervisor.wait_ready` waits for."""
    print(f"{prefix} {json.dumps(info)}", flush=True)


def exit_when_orphaned() -> None:
    """Child side: exit at once (status 0) when the supervisor's stdin pipe closes (it is gone).

    Watches only a pipe a :class:`Supervisor` gave (``orphan_pipe=True``, which puts
    ``PDJAX_ORPHAN_PIPE=1`` in the child's environment; the variable is removed here, so the
    processes this one starts do not inherit it) and only while stdin is a pipe. Anything else
    (a terminal, ``/dev/null``, a file, a shell's pipe) is left alone: a server started by
    hand, in the background, under nohup or in a container with no stdin attached keeps
    serving. The watcher reads the raw descriptor (``os.read``, not ``sys.stdin``), so no
    buffer lock is held at interpreter exit: a start-up that fails ends with its own status,
    not an abort."""
    import stat

    if os.environ.pop(ORPHAN_PIPE_ENV, None) != "1":
        return
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return
    except OSError:                              # no stdin at all
        return

    def watch():
        try:
            while os.read(0, 1 << 16):
                pass
        except OSError:
            pass
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="pdjax-orphan-watch").start()


# ---- parent side ------------------------------------------------------------------------------
class Supervisor:
    """Processes started and watched together (see the module docstring). ``stream``: where
    prefixed output goes (None: nowhere, the tail and log files only); ``tail_lines``: the
    lines kept per process; ``keep``: line prefixes kept beyond the tail (ready lines).
    A context manager: ``close()`` on exit."""

    def __init__(self, *, stream=None, tail_lines: int = 200, keep: Sequence[str] = (READY,)):
        self.stream, self.tail_lines, self.keep = stream, tail_lines, tuple(keep)
        self._procs: list[Child] = []
        self.restarts: list[int] = []
        self.started: list[int] = []             # every pid started, restarts included

    def start(self, argv: Sequence[str], env: Optional[dict] = None, *, name: Optional[str] = None,
              prefix: Optional[str] = None, orphan_pipe: bool = False, log_path: Optional[str] = None,
              die_with_parent: bool = False) -> int:
        """Start ``argv`` with environment ``env`` (None: this process's) in a process group
        of its own; returns its index. ``name`` names it in errors (default "process i");
        ``prefix``: its streamed lines' prefix (default "[i]"); ``orphan_pipe``: its stdin is a
        pipe that closes when this process ends (see :func:`exit_when_orphaned`);
        ``log_path``: a file its whole output is appended to; ``die_with_parent``: Linux
        SIGKILLs it when this process dies, however it ends (call from the main thread: see
        :func:`~pdjax.cluster.children.die_with_parent_argv`). A command that cannot be started
        (not found, not executable) raises :class:`LaunchError` naming it."""
        if isinstance(argv, str) or not argv:
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        i = len(self._procs)
        spec = ProcessSpec(tuple(str(a) for a in argv), None if env is None else dict(env),
                           name or f"process {i}", prefix if prefix is not None else f"[{i}]", orphan_pipe, log_path,
                           die_with_parent)
        try:
            child = Child(spec, self.stream, self.tail_lines, self.keep)
        except (OSError, subprocess.SubprocessError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise LaunchError(f"{spec.name} could not be started: {spec.argv[0]!r}: {why}", i, None, "") from e
        self._procs.append(child)
        self.restarts.append(0)
        self.started.append(self._procs[i].popen.pid)
        return i

    def __len__(self) -> int:
        return len(self._procs)

    def name(self, i: int) -> str:
        return self._procs[i].spec.name

    def pid(self, i: int) -> int:
        return self._procs[i].popen.pid

    def popen(self, i: int) -> subprocess.Popen:
        return self._procs[i].popen

    def poll(self) -> list:
        """Each process's exit code (negative: killed by that signal), None while it runs."""
        return [p.popen.poll() for p in self._procs]

    def exited(self) -> list[int]:
        """Indices of the processes that have exited."""
        return [i for i, c in enumerate(self.poll()) if c is not None]

    def tail(self, i: int, lines: Optional[int] = None) -> str:
        """Process ``i``'s last output lines (all it keeps, or the last ``lines``)."""
        return self._procs[i].tail_text(lines)

    def error(self, i: int, what: Optional[str] = None) -> LaunchError:
        """A LaunchError naming process ``i``: ``what`` happened (default: how it exited)."""
        code = self._procs[i].popen.poll()
        if what is None:
            what = "is running" if code is None else describe_exit(code)
        tail = self.tail(i)
        return LaunchError(f"{self.name(i)} {what}; its last output lines:\n{tail}", i, code, tail)

    def check(self, *, exit_ok: bool = False) -> None:
        """Raise :class:`LaunchError` for the first process that exited non-zero (any exit,
        0 too, unless ``exit_ok``: servers are not meant to exit)."""
        for i, code in enumerate(self.poll()):
            if code is not None and (code != 0 or not exit_ok):
                raise self.error(i)

    def wait_until(self, i: int, ready: Callable[[], object], timeout: float, what: str = "ready",
                   poll_s: float = 0.05):
        """Wait until ``ready()`` returns something other than None/False and return it;
        :class:`LaunchError` if process ``i`` exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value is not None and value is not False:
                return value
            if self._procs[i].popen.poll() is not None:
                raise self.error(i, f"{describe_exit(self._procs[i].popen.returncode)} before it was {what}")
            if time.monotonic() > deadline:
                raise self.error(i, f"was not {what} within {timeout:g} s")
            time.sleep(poll_s)

    def wait_for_line(self, i: int, prefix: str, timeout: float) -> str:
        """The first line of process ``i`` starting with ``prefix`` (kept beyond the tail if
        ``prefix`` is one of ``keep``), the prefix cut off; :class:`LaunchError` if the process
        ends its output first or ``timeout`` seconds pass."""
        p = self._procs[i]
        deadline = time.monotonic() + timeout
        with p.changed:
            while True:
                found = next((ln for ln in (p.kept if prefix in self.keep else p.tail) if ln.startswith(prefix)),
                             None)
                if found is not None:
                    return found[len(prefix):].strip()
                left = deadline - time.monotonic()
                if p.eof or left <= 0:
                    break
                p.changed.wait(left)
        if p.eof:
            p.reap(timeout=5)
            code = p.popen.returncode
            raise self.error(i, f"{describe_exit(code) if code is not None else 'closed its output'} "
                                f"before printing {prefix}")
        raise self.error(i, f"did not print {prefix} within {timeout:g} s")

    def wait_ready(self, i: int, timeout: float, prefix: str = READY) -> dict:
        """The JSON object of process ``i``'s ready line (:func:`announce_ready`)."""
        return json.loads(self.wait_for_line(i, prefix, timeout))

    def kill(self, i: int, wait: bool = True) -> None:
        """SIGKILL process ``i``'s group (and wait for it)."""
        self._procs[i].kill()
        if wait:
            self._procs[i].reap()

    def restart(self, i: int) -> int:
        """Kill process ``i`` if it runs and start it again (same argv, environment, index);
        returns the new pid."""
        old = self._procs[i]
        old.kill()
        old.reap()
        self._procs[i] = Child(old.spec, self.stream, self.tail_lines, self.keep)
        self.restarts[i] += 1
        self.started.append(self._procs[i].popen.pid)
        return self._procs[i].popen.pid

    def wait_all(self, timeout_s: Optional[float] = None, poll_s: float = 0.05, what: str = "launch") -> list[int]:
        """Wait until every process has exited 0 and return the exit codes; at the first one
        that exits non-zero, or past ``timeout_s``, kill every group and raise
        :class:`LaunchError` (naming the process; for the timeout, those still running)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                self.check(exit_ok=True)
            except LaunchError as e:
                blamed = self.blame_stopped(e)
                self.close()
                if blamed is e:
                    raise
                raise blamed from e
            codes = self.poll()
            if all(c == 0 for c in codes):
                return codes
            if deadline is not None and time.monotonic() > deadline:
                running, stopped = [i for i, c in enumerate(codes) if c is None], self.stopped()
                self.close()
                tails = "\n".join(f"{self._procs[i].spec.prefix} {line}" for i in running
                                  for line in self.tail(i, 5).splitlines())
                raise LaunchError(f"the {what} passed its timeout of {timeout_s:g} s with processes {running} "
                                  f"still running{f' ({stopped} stopped: SIGSTOP or a debugger)' if stopped else ''}"
                                  f"; their last output lines:\n{tails}", None, None, tails)
            time.sleep(poll_s)

    def stopped(self) -> list[int]:
        """Indices of the processes that are stopped (state ``T``: SIGSTOP, SIGTSTP; ``t``:
        a debugger): alive, but answering nothing."""
        return [i for i, p in enumerate(self._procs)
                if p.popen.poll() is None and process_state(p.popen.pid) in ("T", "t")]

    def blame_stopped(self, err: LaunchError) -> LaunchError:
        """``err`` (process ``err.process`` ended), or, if another process is stopped, a
        LaunchError naming that one: a stopped process misses the cluster's heartbeats and
        the distributed runtime then aborts the healthy ones (SIGABRT), which are not to blame."""
        stopped = [i for i in self.stopped() if i != err.process]
        if not stopped or err.process is None:
            return err
        i, tail = stopped[0], self.tail(stopped[0])
        return LaunchError(f"{self.name(i)} was stopped (SIGSTOP, SIGTSTP or a debugger) and stopped answering; "
                           f"then {self.name(err.process)} {describe_exit(err.returncode)} (a peer that stops "
                           f"answering fails the cluster); last output lines of {self.name(i)}:\n{tail}",
                           i, None, tail)

    def kill_all(self) -> None:
        """SIGKILL every process group still running (without waiting)."""
        for p in self._procs:
            p.kill()

    def close(self) -> None:
        """SIGKILL every process group still running and wait for each: nothing is left."""
        self.kill_all()
        for p in self._procs:
            p.reap()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
