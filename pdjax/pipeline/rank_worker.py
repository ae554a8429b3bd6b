"""The worker of :class:`pdjax.pipeline.RankProcesses`: one pipeline rank in a process of its
own, pinned to one CPU core, with one CPU device (``python -m pdjax.pipeline.rank_worker
RUN_DIR RANK CORE``, started by the parent's supervisor). It runs the in-process executor's
stage programs and runtime restricted to its rank, takes commands from the parent over a
control connection, and exchanges values with its peers (see the transports in
:mod:`pdjax.pipeline.processes`)."""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time

import numpy as np

from pdjax.cluster.lock import MachineLock



# ---- the worker ------------------------------------------------------------------------------
def _worker(run_dir: str, rank: int, core: int) -> None:
    os.sched_setaffinity(0, {core})          # before jax starts a thread: they all inherit it
    from pdjax.cluster.supervisor import exit_when_orphaned

    exit_when_orphaned()
    with open(os.path.join(run_dir, "spec.pkl"), "rb") as f:
        spec = pickle.load(f)
    _Worker(spec, run_dir, rank).serve()


class _Incoming:
    """A value announced through shared memory, read onto the device by the op that needs
    it, as its first step (so the read is timed with that op, in isolation as in the run, and
    never takes time from an op running meanwhile)."""

    def __init__(self, msg: dict, worker, arrived: float):
        self.msg, self.worker, self.arrived = msg, worker, arrived

    def materialize(self):
        import jax
        import numpy as np

        msg = self.msg
        arr = np.fromfile(msg["path"], dtype=np.dtype(msg["dtype"])).reshape(msg["shape"])
        os.unlink(msg["path"])
        if arr.nbytes != msg["nbytes"]:
            raise ValueError(f"read {arr.nbytes} bytes for {msg['key']}, announced {msg['nbytes']}")
        value = jax.block_until_ready(jax.device_put(arr, self.worker.dev))
        # in flight: the announcement's trip (the bytes were written by the producing op and
        # are read by the consuming one)
        self.worker._landed(msg, time.perf_counter(), self.arrived - msg["sent"])
        return value


class _Worker:
    def __init__(self, spec: dict, run_dir: str, rank: int):
        import jax

        from pdjax.cluster.supervisor import announce_ready
        from pdjax.cluster.transfer import ArraySender, listen, start_transfer_server
        from pdjax.pipeline import stages as st
        from pdjax.pipeline.executor import Executor
        from pdjax.pipeline.runtime import Mailbox

        self.rank, self.run_dir = rank, run_dir
        self.schedule, self.cfg = spec["schedule"], spec["cfg"]
        self.dev = jax.local_devices()[0]
        n = self.schedule.num_ranks
        self.ex = ex = Executor(self.schedule, self.cfg, devices=[self.dev] * n,
                                layers_per_stage=spec["layers_per_stage"], measure=True, timeout_s=spec["timeout_s"])
        ex.local_ranks = {rank}
        params = spec["params"]
        if params is None:
            from pdjax.model.transformer import init_params

            params = jax.jit(init_params, static_argnums=0)(self.cfg, jax.random.key(spec["seed"]))
        sharding = jax.sharding.SingleDeviceSharding(self.dev)
        self.staged = []
        for s, r in enumerate(self.schedule.layout.stage_rank):
            chunk_params = st.chunk_params(params, ex.chunks[ex.stage_chunk[s]])
            if r == rank:
                self.staged.append(jax.device_put(chunk_params, sharding))
            else:     # another rank's stage: its shapes only (nothing of it runs here)
                self.staged.append(jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), chunk_params))
        del params
        self.mail = Mailbox()
        self.transport = spec["transport"]
        self._files = 0
        self.server = start_transfer_server([self.dev])
        self.sender = ArraySender(self.server, ttl_s=spec["timeout_s"])
        self.listener = listen()
        self.lock = MachineLock(os.path.join(run_dir, "ops.lock"))
        self.peers_out: dict = {}
        self.peer_transfer: dict = {}
        self._receivers: dict = {}
        self.transfers: list = []
        self._parent: queue.Queue = queue.Queue()
        self.run = None
        threading.Thread(target=self._accept, daemon=True, name="pdjax-ranks-accept").start()
        host, port = self.listener.getsockname()[:2]
        announce_ready({"rank": rank, "control": f"{host}:{port}", "transfer": self.sender.address,
                        "pid": os.getpid()})

    # ---- connections -----------------------------------------------------------------------
    def _accept(self):
        from pdjax.cluster.transfer import Control

        while True:
            sock, _ = self.listener.accept()
            ctl = Control(sock)
            hello = ctl.recv()
            if hello and hello.get("op") == "parent":
                self._parent.put(ctl)
            elif hello and hello.get("op") == "peer":
                threading.Thread(target=self._receive, args=(ctl, int(hello["rank"])), daemon=True,
                                 name=f"pdjax-ranks-recv{hello['rank']}").start()

    def _receive(self, ctl, src: int):
        """Announced values from rank ``src``, into the mailbox: "transfer" pulls each onto
        this device here; "shm" leaves it to the consumer (:class:`_Incoming`)."""
        from pdjax.cluster.transfer import ArrayReceiver

        try:
            while (msg := ctl.recv()) is not None:
                kind, stage, mb = msg["key"]
                if "path" in msg:       # shared memory
                    self.mail.put((kind, int(stage), int(mb)), _Incoming(msg, self, time.perf_counter()))
                    continue
                if src not in self._receivers:
                    self._receivers[src] = ArrayReceiver(self.peer_transfer[src], self.server)
                value = self._receivers[src].pull(msg, self.dev)
                landed = time.perf_counter()
                self._landed(msg, landed, landed - msg["sent"])
                self.mail.put((kind, int(stage), int(mb)), value)
        except BaseException as exc:  # noqa: BLE001 - the waiting rank reports it
            self.mail.fail(exc)

    def _landed(self, msg, landed: float, latency: float):
        """Book one received value: when it was sent and landed, and the link latency (s):
        the time it was in flight, not time it waited for its consumer."""
        self.transfers.append({"key": msg["key"], "sent": msg["sent"] * 1e3, "landed": landed * 1e3,
                               "latency": latency * 1e3, "nbytes": msg["nbytes"]})

    # the ``remote`` of the rank's run: a value for a stage of another rank
    def prepare(self, key, value):
        """During the producing op: "shm" writes the value's bytes to a file in shared memory
        (the producer's hand-off, timed with its op); "transfer" offers it to the pull."""
        import numpy as np

        if self.transport == "shm":
            arr = np.asarray(value)
            self._files += 1
            path = os.path.join(self.run_dir, f"v{self.rank}-{self._files}.bin")
            with open(path, "wb") as f:
                arr.tofile(f)
            desc = {"path": path, "shape": list(arr.shape), "dtype": str(arr.dtype), "nbytes": int(arr.nbytes)}
        else:
            desc = self.sender.offer(value)
        return key, desc

    def announce(self, handle):
        """Once the producing op's end is recorded: tell the consumer's rank."""
        key, desc = handle
        dest = self.schedule.layout.stage_rank[key[1]]
        self.peers_out[dest].send({"op": "value", "key": list(key), **desc, "sent": time.perf_counter()})

    # ---- commands -------------------------------------------------------------------------
    def serve(self):
        ctl = self._parent.get()
        while (msg := ctl.recv()) is not None:
            try:
                reply = getattr(self, "_cmd_" + msg["op"])(msg)
            except BaseException as exc:  # noqa: BLE001 - the parent raises it
                import traceback

                traceback.print_exc()
                reply = {"op": "error", "error": f"{type(exc).__name__}: {exc}"}
            ctl.send(reply)
        os._exit(0)

    def _cmd_peers(self, msg):
        from pdjax.cluster.transfer import Control

        for info in msg["peers"]:
            r = int(info["rank"])
            if r == self.rank:
                continue
            self.peer_transfer[r] = info["transfer"]
            out = Control.connect(info["control"])
            out.send({"op": "peer", "rank": self.rank})
            self.peers_out[r] = out
        return {"op": "ok"}

    def _cmd_compile(self, msg):
        t = time.perf_counter()
        self.ex.compile(self.staged, tuple(msg["shape"]))
        return {"op": "ok", "seconds": time.perf_counter() - t}

    def _cmd_step(self, msg):
        import jax

        from pdjax.pipeline.runtime import StepRun

        tokens = self.ex.check_batch(np.load(msg["tokens"]))
        self.transport = msg["transport"]
        info = self.ex.compile(self.staged, tokens.shape)
        m = self.schedule.num_microbatches
        b = tokens.shape[0] // m
        run = StepRun(self.ex, info, self.staged, [tokens[i * b:(i + 1) * b] for i in range(m)],
                       self.lock if msg["isolated"] else False, ranks=(self.rank,), mail=self.mail,
                       remote=self)
        jax.block_until_ready((run.tokens_in, run.tokens_out, run.acc, run.one))
        self.transfers = []
        delay = msg["at"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        run.drive()
        self.run = run
        r = self.rank
        base = run.t0 * 1e3
        return {"op": "stepped", "starts": (run.starts[r] + base).tolist(), "ends": (run.ends[r] + base).tolist(),
                "dispatch": run.dispatch[r].tolist() if msg["isolated"] else [],
                "peak": float(run.peak[r]), "stage_memory": {k: v.tolist() for k, v in run.stage_memory.items()},
                "losses": {str(k): float(v) for k, v in run.losses.items()}, "transfers": list(self.transfers)}

    def _cmd_grads(self, msg):
        import jax

        if self.run is None:
            raise RuntimeError("no step has run")
        out = {s: jax.tree.map(np.asarray, g) for s, g in enumerate(self.run.acc) if g is not None}
        with open(msg["path"], "wb") as f:
            pickle.dump(out, f)
        return {"op": "ok", "path": msg["path"]}


if __name__ == "__main__":
    try:
        _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    except BaseException:  # noqa: BLE001 - the log holds the traceback; the parent reports it
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)      # not a normal shutdown: the stdin watcher thread still reads
