"""The launcher of a local cluster: N processes of one command, each told its place in the
cluster (``PDJAX_COORDINATOR``, ``PDJAX_NUM_PROCESSES``, ``PDJAX_PROCESS_ID``) and, on CPU,
given ``devices_per_process`` simulated devices.

Each process runs in a process group of its own; its output (stdout and stderr together) is
streamed line by line with a ``[i]`` prefix and its last lines kept (a
:class:`~pdjax.cluster.supervisor.Supervisor` does the process handling). The launch ends when
every process has exited 0, or at the first failure: a process that exits non-zero (at
start-up, raising, killed by a signal) or the whole launch passing ``timeout_s``. On a
failure every process group still running is sent SIGKILL (jax catches SIGTERM), waited
for, and :class:`LaunchError` names the process, what happened and its last lines.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from pdjax.arguments import check_int, check_positive
from pdjax.cluster.supervisor import LaunchError, Supervisor, device_environ, free_port

__all__ = ["LaunchError", "build_parser", "child_environ", "free_port", "launch", "main"]


def child_environ(process_id: int, num_processes: int, coordinator: str, devices_per_process: int,
                  platform: str, env: Optional[dict] = None) -> dict:
    """The environment of process ``process_id``: this one's, the cluster variables, the
    caller's ``env``; on CPU, ``devices_per_process`` simulated devices."""
    cluster = {"PDJAX_COORDINATOR": coordinator, "PDJAX_NUM_PROCESSES": str(num_processes),
               "PDJAX_PROCESS_ID": str(process_id)}
    return device_environ(devices_per_process, {**cluster, **(env or {})}, platform)


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
    with Supervisor(stream=stream, tail_lines=tail_lines) as procs:
        for i in range(n):
            procs.start(argv, child_environ(i, n, coordinator, devices_per_process, platform, env),
                        name=f"process {i} of {n}")
        return procs.wait_all(timeout_s, poll_s)


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
