"""One operating-system process per pipeline rank, each pinned to its own CPU core.

In one process, XLA:CPU gives every device the same thread pool and every op may use all the
cores, so ranks that run "at once" share the cores and an op's time in a pipeline run is not
its time alone. :class:`RankProcesses` runs rank ``r`` of a schedule in a process of its own,
pinned (``os.sched_setaffinity``) to core ``cores[r]`` before jax starts, with one CPU device:
a rank per core, as a rank per GPU. Each worker is the in-process interpreter
(:class:`pdjax.pipeline.Executor`'s stage programs and runtime) restricted to its rank.

    with RankProcesses(schedule, cfg, params=params) as rp:
        rp.compile(tokens.shape)
        loss = rp.step(tokens)          # rp.last_timeline, rp.last_memory (measured)
        costs = rp.measure_ops(tokens)  # per-op medians in isolation, rp.comm_ms
        grads = rp.grads()              # of the last step, in the params' structure

How values cross ranks (``transport``):

- ``"shm"`` (default): the producing op writes the value's bytes to a file in shared memory
  (``/dev/shm``) as its last step; the consuming op reads them onto its device as its first
  step; a control message (loopback TCP) announces each value. Both copies are timed with
  the ops that make them, in isolation as in the run, and no rank ever needs another
  rank's core to receive: what a GPU's copy engine does beside the compute is, on a CPU
  rank of one core, part of its ops.
- ``"transfer"``: ``jax.experimental.transfer`` (:mod:`pdjax.cluster.transfer`): the producer
  offers the array, a receiving thread of the consumer pulls it. On CPU devices serving a
  pull takes the *producer's* core: measured with a 5 MB array, 2-5 ms when the producer is
  idle, 13-19 ms while it computes, so the link time depends on what the other rank runs.

Times: every worker stamps its ops with ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock
for every process of the machine), so the ranks' timelines share one time axis; a step
starts in every worker at one agreed instant. :meth:`RankProcesses.measure_ops` runs one op
at a time across all processes (a file lock) and measures the link latency (``comm_ms``: a
value's time in flight, from its announcement to its arrival).

The parent process only coordinates: it validates everything first (an :class:`Executor`
that compiles nothing), starts the workers, and kills them (SIGKILL) on close, on any
worker's failure, or when a worker does not answer within ``timeout_s``.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

READY_FILE = "ready-{rank}.json"
TRANSPORTS = ("shm", "transfer")


def available_cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


class _FileLock:
    """A lock shared by processes (``flock`` on one file): one op at a time, machine-wide."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class RankProcesses:
    """Runs ``schedule`` as training steps of model ``cfg`` with one process per rank.

    ``params``: the model's params (host or device arrays; sent to the workers, which keep
    their stages), or None: every worker builds ``pdjax.init_params(cfg, key(seed))``.
    ``cores``: the core of each rank (default: rank r on the r-th available core, cycling
    when there are more ranks than cores). ``layers_per_stage``: as :class:`Executor`.
    ``timeout_s``: how long the parent waits for a worker's answer (and a worker for a value)
    before the run fails. ``env``: extra environment for the workers.

    Each worker has one CPU device; a rank of several devices (expert parallelism inside a
    stage) is the in-process :class:`Executor`'s."""

    def __init__(self, schedule, cfg, *, params=None, seed: int = 0, layers_per_stage=None, cores=None,
                 transport: str = "shm", timeout_s: float = 300.0, startup_timeout_s: float = 180.0,
                 env: dict | None = None):
        import jax

        from pdjax.pipeline.executor import Executor

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        n = schedule.num_ranks
        # the checks of the in-process executor, on stand-in devices (nothing is compiled here)
        self._ex = Executor(schedule, cfg, devices=[jax.devices()[0]] * n, layers_per_stage=layers_per_stage,
                            measure=True, timeout_s=timeout_s)
        if params is not None:
            self._ex.check_params(params)
            params = jax.tree.map(np.asarray, params)
        if cores is None:
            avail = available_cores()
            cores = [avail[r % len(avail)] for r in range(n)]
        cores = [int(c) for c in cores]
        if len(cores) != n:
            raise ValueError(f"cores must give one core per rank ({n}), got {len(cores)}")
        bad = sorted(set(cores) - set(available_cores()))
        if bad:
            raise ValueError(f"cores {bad} are not available to this process (available: {available_cores()})")
        self.schedule, self.cfg, self.cores, self.timeout_s = schedule, cfg, cores, float(timeout_s)
        self.procs: list = []
        self._ctl: list = []
        self._replies: queue.Queue = queue.Queue()
        self.last_timeline = self.last_memory = self.stage_memory = None
        self.comm_ms = float("nan")
        self.transfers: list = []
        self._batches: dict = {}
        self.transport = transport     # may be changed between steps
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self._dir = tempfile.mkdtemp(prefix="pdjax-ranks-", dir=shm)
        with open(os.path.join(self._dir, "spec.pkl"), "wb") as f:
            pickle.dump(dict(schedule=schedule, cfg=cfg, params=params, seed=int(seed),
                             layers_per_stage=layers_per_stage, timeout_s=self.timeout_s, transport=transport), f)
        try:
            for r in range(n):
                self._spawn(r, env)
            infos = [self._wait_ready(r, startup_timeout_s) for r in range(n)]
            self._connect(infos)
            self._ask([{"op": "peers", "peers": infos}] * n)
        except BaseException:
            self.close()
            raise

    # ---- processes -----------------------------------------------------------------------
    def _spawn(self, r: int, extra_env) -> None:
        import jax

        from pdjax.disagg.children import child_env

        # the parent's numerics and compilation cache, then the caller's extra environment
        config = {name.upper(): str(value) for name in ("jax_default_matmul_precision", "jax_compilation_cache_dir",
                                                        "jax_persistent_cache_min_compile_time_secs")
                  if (value := getattr(jax.config, name, None)) is not None}
        env = child_env(1, {**config, **(extra_env or {})})
        log = open(os.path.join(self._dir, f"rank{r}.log"), "ab")
        proc = subprocess.Popen([sys.executable, "-m", "pdjax.pipeline.processes", self._dir, str(r),
                                 str(self.cores[r])], stdin=subprocess.PIPE, stdout=log, stderr=log, env=env)
        log.close()
        self.procs.append(proc)

    def _wait_ready(self, r: int, timeout_s: float) -> dict:
        path = os.path.join(self._dir, READY_FILE.format(rank=r))
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if self.procs[r].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rank {r}'s process did not start (exit code {self.procs[r].poll()}); "
                                   f"log tail:\n{self.log_tail(r)}")
            time.sleep(0.05)
        with open(path) as f:
            return json.load(f)

    def _connect(self, infos) -> None:
        from pdjax.cluster.transfer import Control

        for r, info in enumerate(infos):
            ctl = Control.connect(info["control"])
            ctl.send({"op": "parent"})

            def read(ctl=ctl, r=r):
                try:
                    while (msg := ctl.recv()) is not None:
                        self._replies.put((r, msg))
                except (OSError, ValueError):
                    pass
                self._replies.put((r, None))
            threading.Thread(target=read, daemon=True, name=f"pdjax-ranks-parent{r}").start()
            self._ctl.append(ctl)

    def _ask(self, msgs) -> list[dict]:
        """Send each worker its message; return their answers in rank order. The first
        failure (an error, a worker gone, no answer within ``timeout_s``) stops every worker
        and raises."""
        if not self._ctl:
            raise RuntimeError("the rank processes are closed")
        for r, (ctl, msg) in enumerate(zip(self._ctl, msgs)):
            try:
                ctl.send(msg)
            except OSError as exc:            # the worker is gone: its reader says so next
                self._replies.put((r, {"op": "error", "error": f"cannot reach the process ({exc}); "
                                                             f"exit code {self.procs[r].poll()}"}))
        out: dict = {}
        deadline = time.monotonic() + self.timeout_s
        while len(out) < len(msgs):
            try:
                r, reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                r = min(set(range(len(msgs))) - set(out))
                reply = {"op": "error", "error": f"no answer within {self.timeout_s:.0f} s"}
            if reply is None:
                reply = {"op": "error", "error": f"the process exited (code {self.procs[r].poll()})"}
            if reply.get("op") == "error":
                dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
                if dead and r not in dead:    # a peer's death is the cause, not this rank's error
                    why = (f"the process exited (code {self.procs[dead[0]].poll()}); "
                           f"rank {r} then failed: {reply['error'][:300]}")
                    r, reply = dead[0], {"op": "error", "error": why}
                tail = self.log_tail(r)
                self.close()
                raise RuntimeError(f"rank {r} ({msgs[r]['op']}): {reply['error']}\nlog tail:\n{tail}")
            out[r] = reply
        return [out[r] for r in range(len(msgs))]

    def log_tail(self, r: int, chars: int = 3000) -> str:
        from pdjax.disagg.children import file_tail

        return file_tail(os.path.join(self._dir, f"rank{r}.log"), chars)

    def close(self) -> None:
        """Stop the workers (SIGKILL) and remove their files."""
        for ctl in self._ctl:
            try:
                ctl.close()
            except OSError:
                pass
        self._ctl = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if proc.stdin:
                proc.stdin.close()
        self.procs = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "procs", None):
            self.close()

    # ---- steps -----------------------------------------------------------------------------
    def check_batch(self, tokens) -> np.ndarray:
        """A token batch [B, T] checked as :meth:`Executor.check_batch` does (before any compute)."""
        return np.asarray(self._ex.check_batch(tokens))

    def _batch(self, tokens) -> str:
        """Check a batch (before any compute) and hand it to the workers as a file."""
        tokens = self.check_batch(tokens)
        key = (tokens.shape, tokens.tobytes())
        if key not in self._batches:
            path = os.path.join(self._dir, f"tokens{len(self._batches)}.npy")
            np.save(path, tokens)
            self._batches[key] = path
        return self._batches[key]

    def compile(self, batch_shape) -> list[float]:
        """Compile every worker's programs for a batch ``[B, T]`` (the first step does it
        otherwise); returns each worker's compile seconds."""
        self._ex.check_shape(batch_shape)
        msg = {"op": "compile", "shape": [int(v) for v in batch_shape]}
        return [rep["seconds"] for rep in self._ask([msg] * len(self._ctl))]

    def step(self, tokens, *, isolated: bool = False, lead_s: float = 0.05) -> float:
        """One training step on ``tokens`` [B, T]; returns the loss (the mean next-token loss).
        Sets ``last_timeline`` (measured, the same type ``simulate`` returns), ``last_memory``
        (measured peak bytes per rank) and ``stage_memory`` (per-stage byte model).
        ``isolated``: one op at a time over all processes (see :meth:`measure_ops`)."""
        from pdjax.schedules.simulate import measured_timeline

        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        path = self._batch(tokens)
        at = time.perf_counter() + lead_s
        msg = {"op": "step", "tokens": path, "at": at, "isolated": isolated, "transport": self.transport}
        reps = self._ask([msg] * len(self._ctl))
        starts = [np.asarray(rep["starts"], dtype=float) for rep in reps]
        ends = [np.asarray(rep["ends"], dtype=float) for rep in reps]
        t0 = min((float(s.min()) for s in starts if s.size), default=0.0)
        memory = {k: np.sum([rep["stage_memory"][k] for rep in reps], axis=0) for k in reps[0]["stage_memory"]}
        self.last_timeline = measured_timeline(self.schedule, [s - t0 for s in starts], [e - t0 for e in ends],
                                               memory=memory)
        self.last_memory = np.array([rep["peak"] for rep in reps], dtype=float)
        self.stage_memory = memory
        self.last_dispatch = np.concatenate([np.asarray(rep["dispatch"], dtype=float) for rep in reps])
        self.transfers = [t for rep in reps for t in rep["transfers"]]
        losses = {int(m): v for rep in reps for m, v in rep["losses"].items()}
        return float(sum(losses[m] for m in sorted(losses)))

    def measure_ops(self, tokens, repeats: int = 3):
        """Per-op durations in isolation (one op at a time over every process, inputs on the
        device before its clock starts, outputs ready when it stops): an
        :class:`~pdjax.schedules.measured.OpCosts` of medians. Also sets ``comm_ms``: the median
        time a value is in flight between ranks in these runs (its announcement's trip, and
        its copy onto the consumer's device)."""
        from pdjax.schedules.measured import OpCosts

        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        kept = (self.last_timeline, self.last_memory, self.stage_memory, self.transfers)
        samples, dispatch, links = {}, [], []
        try:
            for _ in range(repeats):
                self.step(tokens, isolated=True)
                tl = self.last_timeline
                for r, ops in enumerate(self.schedule.ops):
                    for op, s, e in zip(ops, tl.starts[r], tl.ends[r]):
                        samples.setdefault(OpCosts.key(op), []).append(float(e - s))
                dispatch.extend(self.last_dispatch.tolist())
                links.extend(t["latency"] for t in self.transfers)
        finally:   # isolated runs are not steps: the last step's measurements stay
            self.last_timeline, self.last_memory, self.stage_memory, self.transfers = kept
        self.comm_ms = float(np.median(links)) if links else 0.0
        return OpCosts(self.schedule.num_stages, {k: float(np.median(v)) for k, v in samples.items()},
                       float(np.median(dispatch)))

    def grads(self) -> dict:
        """The last step's gradients in the params' structure (host arrays on the default
        device; DualPipe's two copies of a chunk summed)."""
        import jax

        from pdjax.model.transformer import init_params

        reps = self._ask([{"op": "grads", "path": os.path.join(self._dir, f"grads{r}.pkl")}
                          for r in range(len(self._ctl))])
        stage_grads = [None] * self.schedule.num_stages
        for rep in reps:
            with open(rep["path"], "rb") as f:
                for s, g in pickle.load(f).items():
                    stage_grads[int(s)] = g
        like = jax.eval_shape(lambda k: init_params(self.cfg, k), jax.random.key(0))
        return self._ex.gather_grads(stage_grads, like)


# ---- the worker ------------------------------------------------------------------------------
def _worker(run_dir: str, rank: int, core: int) -> None:
    os.sched_setaffinity(0, {core})          # before jax starts a thread: they all inherit it
    from pdjax.disagg.children import exit_when_orphaned

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
        self.lock = _FileLock(os.path.join(run_dir, "ops.lock"))
        self.peers_out: dict = {}
        self.peer_transfer: dict = {}
        self._receivers: dict = {}
        self.transfers: list = []
        self._parent: queue.Queue = queue.Queue()
        self.run = None
        threading.Thread(target=self._accept, daemon=True, name="pdjax-ranks-accept").start()
        host, port = self.listener.getsockname()[:2]
        tmp = os.path.join(run_dir, f".ready-{rank}.json")
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "control": f"{host}:{port}", "transfer": self.sender.address,
                       "pid": os.getpid()}, f)
        os.replace(tmp, os.path.join(run_dir, READY_FILE.format(rank=rank)))

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
