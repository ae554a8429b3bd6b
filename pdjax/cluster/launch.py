"""The launcher of a local cluster: N processes of one command, each told its place in the
cluster (``PDJAX_COORDINATOR``, ``PDJAX_NUM_PROCESSES``, ``PDJAX_PROCESS_ID``) and, on CPU,
given ``devices_per_process`` simulated devices.

Each process runs in a process group of its own; its output (stdout and stderr together) is
streamed line by line with a ``[i]`` prefix and its last lines kept. The launch ends when
every process has exited 0, or at the first failure: a process that exits non-zero (at
start-up, raising, killed by a signal) or the whole launch passing ``timeout_s``. On a
failure every process group still running is sent SIGKILL (jax catches SIGTERM), waited
for, and :class:`LaunchError` names the process, what happened and its last lines.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from pdjax.arguments import check_int, check_positive


class LaunchError(RuntimeError):
    """A launch failed: ``process`` (its index, None for a timeout of the whole launch),
    ``returncode`` (None if it was still running), ``tail`` (its last output lines)."""

    def __init__(self, message: str, process: Optional[int], returncode: Optional[int], tail: str):
        super().__init__(message)
        self.process, self.returncode, self.tail = process, returncode, tail


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_environ(process_id: int, num_processes: int, coordinator: str, devices_per_process: int,
                  platform: str, env: Optional[dict] = None) -> dict:
    """The environment of process ``process_id``: this one's, the cluster variables, the
    caller's ``env``; on CPU, ``devices_per_process`` simulated devices."""
    out = dict(os.environ)
    out.update({"PDJAX_COORDINATOR": coordinator, "PDJAX_NUM_PROCESSES": str(num_processes),
                "PDJAX_PROCESS_ID": str(process_id), "PYTHONUNBUFFERED": "1"})
    if platform == "cpu":
        flags = [f for f in out.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        out["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
        out["JAX_PLATFORMS"] = "cpu"
    out.update(env or {})
    return out


class _Process:
    """One launched process: its Popen, and a thread streaming its output with a prefix."""

    def __init__(self, index: int, argv, environ: dict, stream, tail_lines: int):
        self.index = index
        self.tail: collections.deque = collections.deque(maxlen=tail_lines)
        self.popen = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=environ, start_new_session=True)
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream) -> None:
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if stream is not None:
                stream.write(f"[{self.index}] {line}\n")
                stream.flush()

    def kill(self) -> None:
        """SIGKILL its whole process group (it and anything it started)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def tail_text(self) -> str:
        self.reader.join(timeout=2)
        return "\n".join(self.tail)


def launch(argv: Sequence[str], num_processes: int, devices_per_process: int = 1, *,
           timeout_s: Optional[float] = None, env: Optional[dict] = None, platform: str = "cpu",
           stream=sys.stdout, tail_lines: int = 20, poll_s: float = 0.05) -> list[int]:
    """Run ``argv`` as ``num_processes`` processes of one cluster (see the module docstring);
    returns their exit codes (all 0) or raises :class:`LaunchError`. ``stream``: where the
    prefixed output goes (None: nowhere); ``platform``: "cpu" (simulated devices) or
    anything else (the devices are the machine's, e.g. "gpu")."""
    if isinstance(argv, str) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    n = check_int("num_processes", num_processes)
    check_int("devices_per_process", devices_per_process)
    if timeout_s is not None:
        check_positive("timeout_s", timeout_s)
    coordinator = f"127.0.0.1:{free_port()}"
    procs: list[_Process] = []
    try:
        for i in range(n):
            procs.append(_Process(i, argv, child_environ(i, n, coordinator, devices_per_process, platform, env),
                                  stream, tail_lines))
        return _supervise(procs, timeout_s, poll_s)
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _supervise(procs: list, timeout_s: Optional[float], poll_s: float) -> list[int]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.popen.poll() for p in procs]
        failed = next((p for p, c in zip(procs, codes) if c not in (None, 0)), None)
        if failed is not None:
            for p in procs:
                p.kill()
            code = failed.popen.returncode
            what = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                    else f"exited with code {code}")
            tail = failed.tail_text()
            raise LaunchError(f"process {failed.index} of {len(procs)} {what}; its last output lines:\n{tail}",
                              failed.index, code, tail)
        if all(c == 0 for c in codes):
            return codes
        if deadline is not None and time.monotonic() > deadline:
            running = [p.index for p, c in zip(procs, codes) if c is None]
            for p in procs:
                p.kill()
            tails = "\n".join(f"[{p.index}] {line}" for p in procs if p.index in running
                              for line in p.tail_text().splitlines()[-5:])
            raise LaunchError(f"the launch passed its timeout of {timeout_s:g} s with processes {running} still "
                              f"running; their last output lines:\n{tails}", None, None, tails)
        time.sleep(poll_s)


# ---- pdjax launch ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax launch", description="A local cluster of processes running one "
                                "command: pdjax launch --num-processes 2 --devices-per-process 4 -- python s.py")
    p.add_argument("--num-processes", type=int, required=True, help="processes in the cluster")
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="simulated CPU devices of each process (platform cpu)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="fail the launch (and kill every process) past this many seconds")
    p.add_argument("--platform", default="cpu", help="cpu (simulated devices) or the machine's, e.g. gpu")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        build_parser().error("the command to run follows --, e.g. pdjax launch --num-processes 2 -- python s.py")
    cut = argv.index("--")
    args = build_parser().parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        build_parser().error("no command after --")
    try:
        launch(command, args.num_processes, args.devices_per_process, timeout_s=args.timeout,
               platform=args.platform)
    except LaunchError as e:
        print(f"pdjax launch: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"pdjax launch: {e}", file=sys.stderr)
        return 2
    return 0
