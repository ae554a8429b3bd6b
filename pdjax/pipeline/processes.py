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
that compiles nothing), starts the workers (:mod:`pdjax.pipeline.rank_worker`) under a
:class:`pdjax.cluster.supervisor.Supervisor` (their output in its tail and in a log file per
rank), and kills them (SIGKILL to each group) on close, on any worker's failure, or when a
worker does not answer within ``timeout_s``. For ranks in the processes of a
``jax.distributed`` launch (several hosts), build the :class:`Executor` itself over
``jax.devices()`` in every process (:mod:`pdjax.pipeline.spanning`).
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from pdjax.cluster.supervisor import LaunchError, Supervisor, device_environ

PEER_DEATH_GRACE_S = 3.0    # how long a rank's error waits to see whether a peer died first (its cause)

TRANSPORTS = ("shm", "transfer")


def available_cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


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
        self.procs = Supervisor()
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
        self.procs.start([sys.executable, "-m", "pdjax.pipeline.rank_worker", self._dir, str(r), str(self.cores[r])],
                         device_environ(1, extra_env), name=f"rank {r}'s process",
                         orphan_pipe=True, log_path=os.path.join(self._dir, f"rank{r}.log"))

    def _wait_ready(self, r: int, timeout_s: float) -> dict:
        try:
            return self.procs.wait_ready(r, timeout_s)
        except LaunchError as e:
            raise RuntimeError(f"rank {r}'s process did not start: {e}") from None

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

    def _peer_deaths(self, r: int) -> list[int]:
        """The processes seen exited, waiting up to :data:`PEER_DEATH_GRACE_S` for one when
        none has yet: a worker killed mid-step closes its sockets (its peer's error, e.g. a
        connection reset, can arrive first) before its exit can be seen, and on a loaded
        machine that gap is not short. Only an error path waits."""
        deadline = time.monotonic() + PEER_DEATH_GRACE_S
        while not (dead := self.procs.exited()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

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
                                                             f"exit code {self.procs.poll()[r]}"}))
        out: dict = {}
        deadline = time.monotonic() + self.timeout_s
        while len(out) < len(msgs):
            try:
                r, reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                r = min(set(range(len(msgs))) - set(out))
                reply = {"op": "error", "error": f"no answer within {self.timeout_s:.0f} s"}
            if reply is None:
                reply = {"op": "error", "error": f"the process exited (code {self.procs.poll()[r]})"}
            if reply.get("op") == "error":
                dead = self._peer_deaths(r)
                if dead and r not in dead:    # a peer's death is the cause, not this rank's error
                    why = (f"the process exited (code {self.procs.poll()[dead[0]]}); "
                           f"rank {r} then failed: {reply['error'][:300]}")
                    r, reply = dead[0], {"op": "error", "error": why}
                tail = self.log_tail(r)
                self.close()
                raise RuntimeError(f"rank {r} ({msgs[r]['op']}): {reply['error']}\nlog tail:\n{tail}")
            out[r] = reply
        return [out[r] for r in range(len(msgs))]

    def log_tail(self, r: int, chars: int = 3000) -> str:
        """The last ``chars`` characters of rank ``r``'s process output."""
        return self.procs.tail(r)[-chars:] if self.procs is not None else ""

    def close(self) -> None:
        """Stop the workers (SIGKILL) and remove their files."""
        for ctl in self._ctl:
            try:
                ctl.close()
            except OSError:
                pass
        self._ctl = []
        if self.procs is not None:
            self.procs.close()
            self.procs = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "procs", None) is not None:
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
