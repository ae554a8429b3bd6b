"""What a process of a cluster knows about it, and ``initialize``: ``jax.distributed`` set
up so that failures end the process instead of hanging it.

The cluster is read from the environment, in this order: what :func:`pdjax.cluster.launch`
sets (``PDJAX_COORDINATOR``, ``PDJAX_NUM_PROCESSES``, ``PDJAX_PROCESS_ID``); a Kubernetes
indexed job (``JOB_COMPLETION_INDEX`` with ``PDJAX_COORDINATOR`` and
``PDJAX_NUM_PROCESSES`` set in the job's spec); otherwise jax's own cluster detection
(SLURM, ...). Measured facts behind the settings (jax 0.10, CPU, gloo): an uncaught
exception does not end a process that has a distributed client (interpreter exit waits in
``distributed.shutdown`` for its timeout), so ``initialize`` installs an excepthook that
prints the traceback and exits at once; jax's preemption service swallows SIGTERM, so it is
turned off (a launch ends processes with SIGKILL anyway); a process whose peer died waits in
a collective until the heartbeat timeout, which is short by default here. Where jax would
crash or abort, ``initialize`` reports instead: process 0 checks that the coordinator's port
is free (jax segfaults on a taken one), a cluster that does not form within the
initialization timeout (``PDJAX_INITIALIZATION_TIMEOUT``; a process count that does not match
the processes started) ends the process with a message and status 1 (jax would abort it),
and no cluster in the environment names the variables to set.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import traceback
from typing import Optional

from pdjax.arguments import check_int

ENV_COORDINATOR, ENV_NUM, ENV_ID = "PDJAX_COORDINATOR", "PDJAX_NUM_PROCESSES", "PDJAX_PROCESS_ID"
ENV_INIT_TIMEOUT = "PDJAX_INITIALIZATION_TIMEOUT"      # seconds, when initialize is not given one
DEFAULT_INIT_TIMEOUT_S = 120
JAX_GRACE_S = 10             # jax's own deadline is this much later than ours (it aborts the process)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """``coordinator`` (``host:port``, None: let jax detect the cluster), ``num_processes``,
    ``process_id`` (None each: detected)."""

    coordinator: Optional[str]
    num_processes: Optional[int]
    process_id: Optional[int]


def cluster_spec(environ=None) -> ClusterSpec:
    """The cluster this process belongs to, from ``environ`` (default ``os.environ``); see
    the module docstring. Raises ValueError naming a variable that is set but malformed."""
    env = os.environ if environ is None else environ

    def number(name: str) -> Optional[int]:
        if name not in env:
            return None
        try:
            return int(env[name])
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None

    coordinator = env.get(ENV_COORDINATOR)
    num = number(ENV_NUM)
    pid = number(ENV_ID)
    if pid is None and "JOB_COMPLETION_INDEX" in env:
        pid = number("JOB_COMPLETION_INDEX")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{ENV_COORDINATOR} must be host:port, got {coordinator!r}")
        if num is None or pid is None:
            raise ValueError(f"{ENV_COORDINATOR} is set: {ENV_NUM} and {ENV_ID} (or JOB_COMPLETION_INDEX) "
                             "must be set too")
        check_int(ENV_NUM, num)
        check_int(ENV_ID, pid, 0, num - 1)
    return ClusterSpec(coordinator, num, pid)


def _exit_on_uncaught(kind, value, tb) -> None:
    """An uncaught exception ends the process at once with status 1 (the distributed
    runtime's shutdown would otherwise hold it for its whole timeout)."""
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _initialization_timeout(value: Optional[int]) -> int:
    """``value``, else :data:`ENV_INIT_TIMEOUT` (whole seconds), else 120."""
    if value is not None:
        return check_int("initialization_timeout_s", value)
    raw = os.environ.get(ENV_INIT_TIMEOUT)
    if raw is None:
        return DEFAULT_INIT_TIMEOUT_S
    try:
        number = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_INIT_TIMEOUT} must be an integer number of seconds, got {raw!r}") from None
    return check_int(ENV_INIT_TIMEOUT, number)


def _check_coordinator_port(coordinator: str) -> None:
    """Process 0 hosts the coordinator service on the coordinator's port (on every interface,
    or on ``JAX_COORDINATOR_BIND_ADDRESS``): a port already taken is an error here, not a
    crash inside jax."""
    port = coordinator.rpartition(":")[2]
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")
    host, _, bind_port = bind.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError:                              # no IPv6 here: the wildcard of IPv4
        sock, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0" if host == "::" else host
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a TIME_WAIT port is free
        try:
            sock.bind((host, int(bind_port)))
        except OSError as e:
            raise RuntimeError(f"{ENV_COORDINATOR}={coordinator}: this process (process 0) hosts the coordinator "
                               f"and cannot bind its port {bind} ({e.strerror or e}): another process holds it "
                               f"(a cluster still running?); pick a free port (pdjax launch picks one)") from None


def _give_up_after(joined: threading.Event, timeout_s: int, spec: ClusterSpec) -> None:
    """End the process (status 1, with a message) if the cluster has not formed in time:
    jax's own deadline, a little later, would abort it with a C++ check failure."""
    if joined.wait(timeout_s):
        return
    where = f"{ENV_COORDINATOR}={spec.coordinator}" if spec.coordinator else "the coordinator jax detected"
    who = (f"process {spec.process_id} of {spec.num_processes} ({ENV_ID}, {ENV_NUM})"
           if spec.num_processes is not None else "this process")
    print(f"pdjax.cluster.initialize: the cluster did not form within {timeout_s} s: {who} waited at {where} "
          f"for every process to join. Start all the processes with the same {ENV_COORDINATOR} and {ENV_NUM} "
          f"(pdjax launch sets them), or give them longer ({ENV_INIT_TIMEOUT} or initialization_timeout_s)",
          file=sys.stderr, flush=True)
    os._exit(1)


def initialize(*, heartbeat_timeout_s: int = 10, shutdown_timeout_s: int = 10,
               initialization_timeout_s: Optional[int] = None) -> ClusterSpec:
    """Join this process to its cluster (:func:`cluster_spec`) with ``jax.distributed`` and
    return the spec. Call it first, before any other jax call. Afterwards ``jax.devices()``
    lists every process's devices (``jax.local_devices()`` this one's) and collectives cross
    the processes (gloo on CPU, NCCL on GPUs: nothing else changes).

    ``initialization_timeout_s`` (default :data:`ENV_INIT_TIMEOUT`, else 120 s): if not every
    process has joined by then, the process prints why and exits with status 1. Process 0
    checks first that the coordinator's port is free (RuntimeError naming it); with no
    cluster in the environment, ValueError naming what to set."""
    import jax

    spec = cluster_spec()
    check_int("heartbeat_timeout_s", heartbeat_timeout_s)
    check_int("shutdown_timeout_s", shutdown_timeout_s)
    timeout_s = _initialization_timeout(initialization_timeout_s)
    if spec.coordinator is not None and spec.process_id == 0 and not jax.distributed.is_initialized():
        _check_coordinator_port(spec.coordinator)
    jax.config.update("jax_enable_preemption_service", False)
    sys.excepthook = _exit_on_uncaught
    joined = threading.Event()
    threading.Thread(target=_give_up_after, args=(joined, timeout_s, spec), daemon=True,
                     name="pdjax-initialize-deadline").start()
    try:
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                                   initialization_timeout=timeout_s + JAX_GRACE_S,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s,
                                   shutdown_timeout_seconds=shutdown_timeout_s)
    except ValueError as e:
        if spec.coordinator is not None:
            raise
        raise ValueError(f"pdjax.cluster.initialize: no cluster in the environment ({e}): start the processes "
                         f"with `pdjax launch` (or pdjax.cluster.launch), or set {ENV_COORDINATOR} (host:port of "
                         f"process 0), {ENV_NUM} and {ENV_ID} in each (or run under SLURM or a Kubernetes "
                         "indexed job)") from e
    finally:
        joined.set()
    return ClusterSpec(spec.coordinator, jax.process_count(), jax.process_index())
