"""The launcher of a local cluster: N processes of one command, each told its place in the
cluster (``PDJAX_COORDINATOR``, ``PDJAX_NUM_PROCESSES``, ``PDJAX_PROCESS_ID``) and, on CPU,
given ``devices_per_process`` simulated devices.

Each process runs in a process group of its own; its output (stdout and stderr together) is
streamed line by line with a ``[i]`` prefix and its last lines kept (a
:class:`~pdjax.cluster.supervisor.Supervisor` does the process handling). The launch ends when
every process has exited 0, or at the first failure: a process that exits non-zero (at
start-up, raising, killed by a signal) or the whole launch passing ``timeout_s``. On a
failure every process group still running is sent SIGKILL (jax catches SIGTERM), waited
for, and :class:`LaunchError` names the process, what happened and its last lines (a
process that was stopped, SIGSTOP or a debugger, is named rather than the healthy ones the
cluster's heartbeat then aborts).

The processes die with the launcher however it ends: Linux SIGKILLs each when the launcher
dies (``PR_SET_PDEATHSIG``, SIGKILL of the launcher included), and ``pdjax launch`` stopped by
SIGINT (Ctrl-C), SIGTERM or SIGHUP kills them, says so in one line and exits 128 + the signal.
Every option is checked before anything starts (a bad one: exit 2, naming it and its value);
a command that cannot be run is a :class:`LaunchError`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
from typing import Optional, Sequence

from pdjax.arguments import check_int, check_positive
from pdjax.cluster.children import PIN_CORES_ENV
from pdjax.cluster.supervisor import PLATFORMS, LaunchError, Supervisor, device_environ, free_port

__all__ = ["LaunchError", "Interrupted", "available_cores", "build_parser", "check_command", "child_environ", "free_port", "launch",
           "main"]


def child_environ(process_id: int, num_processes: int, coordinator: str, devices_per_process: int,
                  platform: str, env: Optional[dict] = None) -> dict:
    """The environment of process ``process_id``: this one's, the cluster variables, the
    caller's ``env``; on CPU, ``devices_per_process`` simulated devices."""
    cluster = {"PDJAX_COORDINATOR": coordinator, "PDJAX_NUM_PROCESSES": str(num_processes),
               "PDJAX_PROCESS_ID": str(process_id)}
    return device_environ(devices_per_process, {**cluster, **(env or {})}, platform)


def check_command(command: str, env: Optional[dict] = None) -> str:
    """The executable ``command`` runs (looked up on ``env``'s PATH, as the child will);
    :class:`LaunchError` naming it if there is none."""
    path = (os.environ if env is None else env).get("PATH", os.defpath)
    found = shutil.which(command, path=path)
    if found is None:
        where = "" if os.sep in command else " on PATH"
        raise LaunchError(f"cannot run {command!r}: no such executable{where}", None, None, "")
    return found


def _check_options(argv, num_processes, devices_per_process, timeout_s, platform, tail_lines, poll_s, names):
    """Every argument of :func:`launch` checked (errors name ``names[k]``, the Python
    argument or the command line's option), before anything starts; returns the count."""
    if isinstance(argv, str) or not argv:
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    n = check_int(names[0], num_processes)
    check_int(names[1], devices_per_process)
    if timeout_s is not None:
        check_positive(names[2], timeout_s)
    if platform not in PLATFORMS:
        raise ValueError(f"{names[3]} must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    if platform != "cpu" and devices_per_process != 1:
        raise ValueError(f"{names[1]} counts simulated CPU devices ({names[3]} cpu); on {platform} the devices "
                         f"are the machine's (set e.g. CUDA_VISIBLE_DEVICES): got {devices_per_process}")
    check_int("tail_lines", tail_lines)
    check_positive("poll_s", poll_s)
    return n


def launch(argv: Sequence[str], num_processes: int, devices_per_process: int = 1, *,
           timeout_s: Optional[float] = None, env: Optional[dict] = None, platform: str = "cpu",
           stream=sys.stdout, tail_lines: int = 20, poll_s: float = 0.05, pin_cores=False) -> list[int]:
    """Run ``argv`` as ``num_processes`` processes of one cluster (see the module docstring);
    returns their exit codes (all 0) or raises :class:`LaunchError` (a command that cannot
    be run too). ``stream``: where the prefixed output goes (None: nowhere); ``platform``:
    "cpu" (simulated devices) or the machine's (one of :data:`PLATFORMS`, e.g. "gpu").
    ``pin_cores``: True pins process i to the i-th core this process may run on (cycling when
    there are more processes; one rank per core, as one rank per GPU), or a list of core ids
    to take in turn; Linux only, set before the command starts (its threads inherit it).
    Bad arguments raise ValueError before anything starts. Each process is SIGKILLed by
    Linux if this process dies, however it ends (call from the main thread)."""
    n = _check_options(argv, num_processes, devices_per_process, timeout_s, platform, tail_lines, poll_s,
                       ("num_processes", "devices_per_process", "timeout_s", "platform"))
    cores = _cores(pin_cores)
    coordinator = f"127.0.0.1:{free_port()}"
    envs = [child_environ(i, n, coordinator, devices_per_process, platform, env) for i in range(n)]
    for i, e in enumerate(envs if cores else ()):
        e[PIN_CORES_ENV] = str(cores[i % len(cores)])
    check_command(os.fspath(argv[0]) if isinstance(argv[0], os.PathLike) else str(argv[0]), envs[0])
    with Supervisor(stream=stream, tail_lines=tail_lines) as procs:
        for i in range(n):
            procs.start(argv, envs[i], name=f"process {i} of {n}", die_with_parent=True)
        return procs.wait_all(timeout_s, poll_s)


def available_cores() -> list[int]:
    """The CPU cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cores(pin_cores) -> list[int]:
    """``launch``'s ``pin_cores`` as the list of cores to take in turn ([] for False)."""
    if pin_cores is False:
        return []
    if not (sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")):
        raise ValueError("pin_cores needs Linux (sched_setaffinity)")
    if pin_cores is True:
        return available_cores()
    if isinstance(pin_cores, (str, bytes)) or not hasattr(pin_cores, "__iter__"):
        raise ValueError(f"pin_cores must be True, False or a list of core ids, got {pin_cores!r}")
    cores = [check_int("pin_cores entry", c, 0) for c in pin_cores]
    if not cores or not set(cores) <= set(available_cores()):
        raise ValueError(f"pin_cores must name cores this process may run on ({available_cores()}), got {cores}")
    return cores


# ---- pdjax launch ----------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
USAGE = ("pdjax launch --num-processes N [--devices-per-process D] [--timeout SECONDS] [--platform P] "
         "[--pin-cores] -- command ...")


class Interrupted(BaseException):
    """The launcher got a stop signal (``signum``: SIGINT, SIGTERM or SIGHUP); raised in the
    main thread, so that leaving the launch kills every process."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """Within: SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (once: repeats are ignored
    while the processes are killed); a signal this process was told to ignore (``nohup``,
    a background job's SIGINT) stays ignored. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def stop(signum, frame):
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)
    try:
        for s, handler in previous.items():
            if handler is not signal.SIG_IGN:
                signal.signal(s, stop)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax launch", usage=USAGE, description="A local cluster of processes "
                                "running one command: pdjax launch --num-processes 2 --devices-per-process 4 "
                                "-- python s.py. The command follows --.")
    p.add_argument("--num-processes", type=int, required=True, help="processes in the cluster (>= 1)")
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="simulated CPU devices of each process (platform cpu; >= 1, default 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="fail the launch (and kill every process) past this many seconds (> 0)")
    p.add_argument("--platform", default="cpu", choices=PLATFORMS,
                   help="cpu (simulated devices) or the machine's, e.g. gpu (default cpu)")
    p.add_argument("--pin-cores", action="store_true",
                   help="pin process i to the i-th core this launcher may run on (a rank per core; Linux)")
    return p


def main(argv=None) -> int:
    """``pdjax launch``: 0 when every process exited 0; 1 for a failed launch, 2 for bad
    options (before anything starts), 128 + the signal for a launcher stopped by SIGINT,
    SIGTERM or SIGHUP (every process killed); each failure one message on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    cut = argv.index("--") if "--" in argv else len(argv)
    if cut == len(argv) and not {"-h", "--help"} & set(argv):
        parser.error("the command to run follows --, e.g. pdjax launch --num-processes 2 -- python s.py")
    args = parser.parse_args(argv[:cut])            # --help: the usage, exit 0
    command = argv[cut + 1:]
    if not command:
        parser.error("no command after --")
    try:
        _check_options(command, args.num_processes, args.devices_per_process, args.timeout, args.platform, 20, 0.05,
                       ("--num-processes", "--devices-per-process", "--timeout", "--platform"))
        _cores(args.pin_cores)
    except ValueError as e:
        parser.error(str(e))
    try:
        with stop_on_signals():
            launch(command, args.num_processes, args.devices_per_process, timeout_s=args.timeout,
                   platform=args.platform, pin_cores=args.pin_cores)
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"pdjax launch: stopped by {signal.Signals(signum).name}; every process of the launch was killed",
              file=sys.stderr)
        return 128 + signum
    except LaunchError as e:
        print(f"pdjax launch: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"pdjax launch: {e}", file=sys.stderr)
        return 2
    return 0
