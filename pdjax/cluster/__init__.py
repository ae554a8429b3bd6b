"""Multi-process pdjax on ``jax.distributed``: one launcher for local clusters, and the
``initialize`` every process of a launch (or of a SLURM job, a Kubernetes indexed job) calls
first.

    pdjax launch --num-processes 2 --devices-per-process 4 --timeout 120 -- python my_script.py
    # my_script.py, first thing:
    pdjax.cluster.initialize()
    mesh = pdjax.parallel.make_mesh({"data": 2, "expert": 4})     # over every process's devices

:func:`launch` is the same launcher from Python; :class:`Supervisor` the process handling
under it and under the PD servers (start, ready line, kill, restart, tail, close). See
docs/cluster.md.
"""

from pdjax.cluster.launch import LaunchError, launch
from pdjax.cluster.process import ClusterSpec, cluster_spec, initialize
from pdjax.cluster.supervisor import Supervisor

__all__ = ["ClusterSpec", "LaunchError", "Supervisor", "cluster_spec", "initialize", "launch"]
