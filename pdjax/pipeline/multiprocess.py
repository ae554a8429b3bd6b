"""An executor whose ranks live in several processes of one ``jax.distributed`` cluster.

Multi-controller, as the rest of JAX: every process of the launch builds the same
:class:`pdjax.pipeline.Executor` over the same global ``devices`` and calls ``step`` with the
same params and batch; each process compiles and runs only its own ranks (a rank's devices
are all in one process). A value for a stage of another process crosses a
:class:`~pdjax.pipeline.links.ProcessLink`: the producer offers it on its
:class:`~pdjax.cluster.transfer.ArraySender` as its op's last step and, once the op's end is
recorded, puts the descriptor in the cluster's key-value store (:mod:`pdjax.cluster.store`)
under a name both sides derive from the step and the value's key; the consumer's rank waits for it when its op
needs the value (idle time before the op, with the executor's ``timeout_s`` as its
deadline), then pulls it with its :class:`~pdjax.cluster.transfer.ArrayReceiver` (a deadline
and a layout check on every pull). (A pull issued before the offer usually lands when the
offer comes, but not always: measured, 1 step in 5 hung; so the consumer waits for the word.)

After the ranks' work, one jitted sum over a mesh of one device per process (a gloo/NCCL
all-reduce) gives every process the loss and the gradients, replicated over that mesh
(:attr:`Spanning.replicated`; params given in that placement keep a training loop on it).
When measuring, the processes' op times, peaks and per-stage bytes are gathered too, on one
clock: the processes pass a barrier (the coordinator's) and each times its ops from its exit
(on one host every process reads the same monotonic clock, so their absolute times are used
as they are).
"""

from __future__ import annotations

import json
import os
import secrets
import socket

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.cluster import store
from pdjax.cluster.transfer import SHM, ArrayReceiver, ArraySender, start_transfer_server
from pdjax.pipeline.links import ProcessLink, source_stage

_ADDRESS_BYTES = 256
COMPILE_WAIT_S = 3600.0


def local_ranks(ranks) -> set[int] | None:
    """The ranks whose devices are this process's (None: every rank is). A rank with devices
    in two processes is refused."""
    mine = set(jax.local_devices())
    local, remote = set(), set()
    for rank in ranks:
        here = [d in mine for d in rank.devices]
        if all(here):
            local.add(rank.index)
        elif any(here):
            raise ValueError(f"rank {rank.index}'s devices {[d.id for d in rank.devices]} span processes; give "
                             "each rank devices of one process (consecutive groups of jax.devices())")
        else:
            remote.add(rank.index)
    if not remote:
        return None
    if not local:
        raise ValueError(f"process {jax.process_index()} holds none of the executor's ranks; every process of "
                         "the launch must hold at least one (give the executor devices of every process)")
    return local


def _strings_allgather(text: str) -> list[str]:
    raw = np.zeros(_ADDRESS_BYTES, np.uint8)
    data = text.encode()[:_ADDRESS_BYTES]
    raw[:len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(raw))
    return [bytes(r).rstrip(b"\0").decode() for r in rows]


class Spanning:
    """The cross-process part of an :class:`~pdjax.pipeline.Executor` (built by it when its
    devices span processes; collective: every process builds it at the same point)."""

    def __init__(self, ex, local: set[int]):
        self.ex, self.local = ex, frozenset(local)
        devices = [d for r in ex.ranks if r.index in local for d in r.devices]
        hosts = _strings_allgather(socket.gethostname())
        self.one_host = len(set(hosts)) == 1
        # CPU processes of one host: shared memory (a transfer pull would take the producing
        # rank's core); otherwise jax.experimental.transfer
        self.transport = SHM if self.one_host and devices[0].platform == "cpu" else "transfer"
        self.server = None if self.transport == SHM else start_transfer_server(devices)
        addresses = _strings_allgather(SHM if self.server is None else self.server.address())
        me = jax.process_index()
        # in a launch's output (a failed launch's error quotes the failed process's last lines)
        print(f"pdjax.pipeline: process {me} of {jax.process_count()} runs ranks "
              f"{', '.join(map(str, sorted(local)))}", flush=True)
        self.sender = ArraySender(self.server, ttl_s=ex.timeout_s, transport=self.transport)
        self.receivers = {p: ArrayReceiver(a, server=self.server, timeout_s=ex.timeout_s)
                          for p, a in enumerate(addresses) if p != me}
        nonce = np.array(secrets.randbits(24), np.int64)
        self.nonce = int(multihost_utils.broadcast_one_to_all(nonce))
        self.steps = 0
        self._measured_key = None
        self._lock = None
        # one device per process (its first rank's first device): where the step's results live
        leads = {}
        for rank in ex.ranks:
            leads.setdefault(rank.devices[0].process_index, rank.devices[0])
        self.lead = leads[me]
        self.mesh = Mesh(np.array([leads[p] for p in sorted(leads)]), ("process",))
        self.replicated = NamedSharding(self.mesh, P())
        self._stacked = NamedSharding(self.mesh, P("process"))
        self._sum = jax.jit(lambda t: jax.tree.map(lambda a: a.sum(0), t), out_shardings=self.replicated)

    # ---- values between processes ------------------------------------------------------------
    def machine_lock(self):
        """The lock isolated op timing holds around each op: one per machine for this
        executor (its processes on one host share it)."""
        import tempfile

        from pdjax.cluster.lock import MachineLock

        if self._lock is None:
            self._lock = MachineLock(os.path.join(tempfile.gettempdir(), f"pdjax-pipeline-ops-{self.nonce}.lock"))
        return self._lock

    def link_for(self, run) -> ProcessLink:
        """The :class:`~pdjax.pipeline.links.ProcessLink` of a step's
        :class:`~pdjax.pipeline.step_run.StepRun`: what this process's ranks send to the ranks
        of other processes and receive from them, this step."""
        ex = self.ex
        lay = ex.schedule.layout
        incoming = {}
        for s in range(ex.schedule.num_stages):   # values this process's stages receive from others
            if not run.local_stage[s]:
                continue
            info = run.info[s]
            for kind, src, spec in (("act", lay.prev_stage[s], info.x), ("grad", lay.next_stage[s], info.gy)):
                if src is None or run.local_stage[src] or (kind == "act" and info.chunk.first) or \
                        (kind == "grad" and info.chunk.last):
                    continue
                proc = ex.ranks[lay.stage_rank[src]].devices[0].process_index
                wire = ex.ranks[lay.stage_rank[s]].batch(len(spec.shape))
                for m in lay.pipeline_of_stage(s).microbatches:
                    incoming[(kind, s, m)] = (proc, wire, spec.sharding)

        def outgoing_sharding(key, ndim):
            """The producer's rank, the batch split as the consumer's rank splits it."""
            return ex.ranks[lay.stage_rank[source_stage(lay, key)]].batch(ndim)
        return ProcessLink(self.sender, self.receivers, f"pdjax/pipeline/{self.nonce}/{self.steps}/values",
                           incoming, outgoing_sharding, ex.timeout_s)

    def run(self, run):
        """Run this process's ranks of a step (``run``: a StepRun of them). Returns this
        process's part of the loss (on its lead device; zero where it runs no last stage) and
        the per-stage grads (None for the stages of other processes).

        The step's transfers are all done before any device collective starts: on CPU a
        device that waits in a collective does not serve a pull, so a process that went on to
        the results' sum while its peer still pulled from it would hang both (measured)."""
        name = f"pdjax/pipeline/{self.nonce}/{self.steps}"
        # one start, one clock; a peer may still be compiling its first step (a dead one
        # fails the barrier through the cluster's heartbeat)
        store.barrier(name + "/start", max(self.ex.timeout_s, COMPILE_WAIT_S))
        if self._measured_key is not None:       # every process is past the last step's gather
            store.delete(self._measured_key)
            self._measured_key = None
        try:
            run.drive()
            jax.block_until_ready([a for a in run.acc if a is not None])   # every pull has landed
            store.barrier(name + "/end", self.ex.timeout_s)
        finally:
            self.steps += 1
        last = self.ex.schedule.layout.pipelines[0].stages[-1]
        loss = jnp.zeros((), run.info[last].prog.y_shape.dtype, device=self.lead)
        for m in sorted(run.losses):
            loss = loss + jax.device_put(run.losses[m], self.lead)
        if self.ex.measure:
            self.gather_measurements(run, name)
        return loss, run.acc

    # ---- results --------------------------------------------------------------------------------
    def place_leaf(self, a):
        """A param leaf as a host or single-device value this process can place: a global
        array's copy on this process (params replicated over :attr:`replicated`)."""
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if not a.is_fully_replicated:
                raise ValueError("params spanning processes must be replicated (e.g. over "
                                 "Executor.replicated), got a leaf sharded as " + str(a.sharding))
            return a.addressable_data(0)
        return a

    def combine(self, loss, partial_grads):
        """The loss and gradients summed over the processes (each gives its part on its lead
        device, zeros where it holds nothing), replicated over :attr:`replicated`."""
        n = self.mesh.size

        def stack(a):
            a = jax.device_put(a, self.lead)[None]
            return jax.make_array_from_single_device_arrays((n, *a.shape[1:]), self._stacked, [a])
        return self._sum(jax.tree.map(stack, (loss, partial_grads)))

    def gather_measurements(self, run, name: str):
        """Every rank's op times (and dispatch times), every process's peaks and per-stage
        bytes, through the cluster's key-value store (exact float64 as JSON; jax's own
        gathers run in float32 unless x64 is on, too coarse for clock readings and bytes)."""
        sched = self.ex.schedule
        offset = (run.t0 if self.one_host else 0.0) * 1e3     # on one host: absolute times
        mine = {"ranks": {r: [(run.starts[r] + offset).tolist(), (run.ends[r] + offset).tolist(),
                              run.dispatch[r].tolist()] for r in self.local},
                "peak": run.peak.tolist(), "stage_memory": {k: v.tolist() for k, v in run.stage_memory.items()}}
        me, n = jax.process_index(), self.mesh.size
        self._measured_key = f"{name}/measured/{me}"       # deleted at the next step's start
        store.put(self._measured_key, json.dumps(mine))
        parts = [mine if p == me else json.loads(store.get(f"{name}/measured/{p}", self.ex.timeout_s))
                 for p in range(n)]
        for part in parts:
            for r, (starts, ends, dispatch) in part["ranks"].items():
                run.starts[int(r)], run.ends[int(r)], run.dispatch[int(r)] = (np.asarray(v, float)
                                                                                for v in (starts, ends, dispatch))
        base = min((float(st.min()) for st in run.starts if st.size), default=0.0)
        run.t0 = 0.0
        for r in range(sched.num_ranks):          # times from the first op's start, on every process
            run.starts[r], run.ends[r] = run.starts[r] - base, run.ends[r] - base
        run.peak = np.sum([part["peak"] for part in parts], axis=0)
        run.stage_memory = {k: np.sum([part["stage_memory"][k] for part in parts], axis=0)
                            for k in run.stage_memory}
