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
  (its exit code or signal and its last lines);
- ``kill(i)`` (SIGKILL to its group: jax catches SIGTERM), ``restart(i)`` (same argv and
  environment, same index), ``close()`` (SIGKILL to every group, wait for each: no process is
  left behind).

Child side: :func:`announce_ready`, :func:`exit_when_orphaned` (with ``orphan_pipe=True`` the
child's stdin is a pipe from the supervisor; the child exits when it closes, i.e. when the
supervising process is gone however it ended), :func:`device_environ`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

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


def device_environ(device_count: int, extra: dict | None = None, platform: str = "cpu") -> dict:
    """The environment of a child jax process: this one's, on ``platform`` (on "cpu" with
    ``device_count`` simulated devices; other platforms: set the visible devices in ``extra``,
    e.g. ``CUDA_VISIBLE_DEVICES``), unbuffered output, the pdjax this process runs importable
    (a checkout that is not installed), then ``extra``."""
    env = dict(os.environ)
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
    """Child side: exit at once when the supervisor's stdin pipe closes (it is gone)."""
    def watch():
        try:
            while sys.stdin.buffer.read(1 << 16):
                pass
        finally:
            os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


# ---- parent side ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What :meth:`Supervisor.start` was given (kept for ``restart``)."""
    argv: tuple
    env: Optional[dict]
    name: str
    prefix: Optional[str]
    orphan_pipe: bool
    log_path: Optional[str]


class _Process:
    """One started process: its Popen and the thread reading its output."""

    def __init__(self, spec: ProcessSpec, stream, tail_lines: int, keep: tuple):
        self.spec, self.keep = spec, keep
        self.tail: collections.deque = collections.deque(maxlen=tail_lines)
        self.kept: list = []                       # lines starting with a ``keep`` prefix, never dropped
        self.eof = False
        self.changed = threading.Condition()
        self.popen = subprocess.Popen(list(spec.argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.PIPE if spec.orphan_pipe else subprocess.DEVNULL,
                                      env=spec.env, start_new_session=True)
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


class Supervisor:
    """Processes started and watched together (see the module docstring). ``stream``: where
    prefixed output goes (None: nowhere, the tail and log files only); ``tail_lines``: the
    lines kept per process; ``keep``: line prefixes kept beyond the tail (ready lines).
    A context manager: ``close()`` on exit."""

    def __init__(self, *, stream=None, tail_lines: int = 200, keep: Sequence[str] = (READY,)):
        self.stream, self.tail_lines, self.keep = stream, tail_lines, tuple(keep)
        self._procs: list[_Process] = []
        self.restarts: list[int] = []
        self.started: list[int] = []             # every pid started, restarts included

    def start(self, argv: Sequence[str], env: Optional[dict] = None, *, name: Optional[str] = None,
              prefix: Optional[str] = None, orphan_pipe: bool = False, log_path: Optional[str] = None) -> int:
        """Start ``argv`` with environment ``env`` (None: this process's) in a process group
        of its own; returns its index. ``name`` names it in errors (default "process i");
        ``prefix``: its streamed lines' prefix (default "[i]"); ``orphan_pipe``: its stdin is a
        pipe that closes when this process ends (see :func:`exit_when_orphaned`);
        ``log_path``: a file its whole output is appended to."""
        if isinstance(argv, str) or not argv:
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        i = len(self._procs)
        spec = ProcessSpec(tuple(str(a) for a in argv), None if env is None else dict(env),
                           name or f"process {i}", prefix if prefix is not None else f"[{i}]", orphan_pipe, log_path)
        self._procs.append(_Process(spec, self.stream, self.tail_lines, self.keep))
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
        self._procs[i] = _Process(old.spec, self.stream, self.tail_lines, self.keep)
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
            except LaunchError:
                self.close()
                raise
            codes = self.poll()
            if all(c == 0 for c in codes):
                return codes
            if deadline is not None and time.monotonic() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                self.close()
                tails = "\n".join(f"{self._procs[i].spec.prefix} {line}" for i in running
                                  for line in self.tail(i, 5).splitlines())
                raise LaunchError(f"the {what} passed its timeout of {timeout_s:g} s with processes {running} "
                                  f"still running; their last output lines:\n{tails}", None, None, tails)
            time.sleep(poll_s)

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
