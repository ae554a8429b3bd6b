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
a collective until the heartbeat timeout, which is short by default here.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from typing import Optional

from pdjax.arguments import check_int

ENV_COORDINATOR, ENV_NUM, ENV_ID = "PDJAX_COORDINATOR", "PDJAX_NUM_PROCESSES", "PDJAX_PROCESS_ID"


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


def initialize(*, heartbeat_timeout_s: int = 10, shutdown_timeout_s: int = 10,
               initialization_timeout_s: int = 120) -> ClusterSpec:
    """Join this process to its cluster (:func:`cluster_spec`) with ``jax.distributed`` and
    return the spec. Call it first, before any other jax call. Afterwards ``jax.devices()``
    lists every process's devices (``jax.local_devices()`` this one's) and collectives cross
    the processes (gloo on CPU, NCCL on GPUs: nothing else changes)."""
    import jax

    spec = cluster_spec()
    for name, value in (("heartbeat_timeout_s", heartbeat_timeout_s), ("shutdown_timeout_s", shutdown_timeout_s),
                        ("initialization_timeout_s", initialization_timeout_s)):
        check_int(name, value)
    jax.config.update("jax_enable_preemption_service", False)
    sys.excepthook = _exit_on_uncaught
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                               initialization_timeout=initialization_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               shutdown_timeout_seconds=shutdown_timeout_s)
    return ClusterSpec(spec.coordinator, jax.process_count(), jax.process_index())
