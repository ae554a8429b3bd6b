"""PD-disaggregated and colocated serving engines over real meshes.

``PDEngine``: a prefill pool and a decode pool on disjoint devices, each with its own mesh
and parallel layout (prefill: small EP; decode: DP attention + EP over a paged cache). The
decode loop (the calling thread) drives the decode scheduler
(:class:`pdjax.disagg.scheduler.DecodeScheduler`, the state machine every PD deployment
shares): it releases each request at its arrival; the scheduler pre-allocates its KV blocks
on a decode rank (back-pressure when the pool is full) and starts a prefill attempt, which
this driver gives to the prefill worker predicted to finish it first; the worker prefills
layer by layer and pushes each layer's latent rows to the decode rank that owns the blocks;
the scheduler writes arriving layers into the blocks, admits a request to the running batch
once its prefill is ready, and the loop steps the batch (continuous batching: requests join
and leave between steps). A failed attempt is prefilled again; so is one that makes no
progress for ``handoff_timeout_s`` (the worker stops it at its next layer; late layers are
ignored).

Several prefill workers (``prefill_workers``: the prefill devices split into equal meshes)
share one prefix cache; each attempt goes to the worker predicted to finish it first under
the prefill cost model (``prefill_cost``, a callable cost(q, c) in seconds such as a fitted
:class:`~pdjax.analysis.costmodel_fit.PrefillCostFit`; measured on this engine's own prefill
pool by :meth:`PDEngine.calibrate_prefill` when not given). Chunked prefill: with
``prefill_budget_s`` each chunk is the largest that fits the budget under the cost model
given the tokens already cached (``prefill_chunk_tokens`` caps it, or alone fixes it).

``ColocatedEngine``: the same scheduler with both pools on the same devices (no link); as in
a single-pool engine, a step is either a prefill chunk or a decode step (a FIFO lock lets a
waiting decode step in between chunks), so an unchunked long prefill stalls the running
decodes.
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import threading

import jax
import numpy as np

from pdjax.config import ModelConfig
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.prefill import PrefillPool, chunk_plan
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError, PrefixStore
from pdjax.disagg.request import Clock, Request, RequestError, SamplingParams, validate_request
from pdjax.disagg.scheduler import (Admitted, CancelPrefill, DecodeScheduler, Failed, LayerArrived, Ready, Started,
                                    StartPrefill, Stepped, Submit, Tick, Token)
from pdjax.disagg.scheduling import FifoLock, Signals, largest_chunk, measure_link_bandwidth, whole_buckets


class _Crashed:
    """A prefill worker died: the decode loop re-raises its error."""

    def __init__(self, error: BaseException):
        self.error = error


class _Cancelled(Exception):
    """An attempt the scheduler abandoned: stop computing it, send nothing more."""


class PDEngine:
    """Prefill/decode disaggregation. See the module docstring; ``generate`` returns one token
    list per prompt, in request order (a :class:`RequestError` in place of a bad request)."""

    def __init__(self, params, cfg: ModelConfig, *, prefill_devices, decode_devices,
                 prefill_mesh=None, decode_mesh=None, block_size: int = 16, max_decode_slots: int = 8,
                 max_context: int | None = None, num_blocks: int | None = None, prefix_cache: bool = False,
                 max_prefill_attempts: int = 3, colocated: bool = False, prefill_workers: int = 1,
                 prefill_cost=None, prefill_budget_s: float | None = None,
                 prefill_chunk_tokens: int | None = None, handoff_timeout_s: float | None = None,
                 link_bandwidth_Bps: float | None = None):
        prefill_devices, decode_devices = list(prefill_devices), list(decode_devices)
        if not colocated and {d.id for d in prefill_devices} & {d.id for d in decode_devices}:
            raise ValueError("prefill_devices and decode_devices must be disjoint (use ColocatedEngine to share)")
        if not isinstance(prefill_workers, int) or prefill_workers < 1 or len(prefill_devices) % prefill_workers:
            raise ValueError(f"prefill_workers={prefill_workers!r} must be a positive integer dividing the "
                             f"{len(prefill_devices)} prefill devices")
        if colocated and prefill_workers != 1:
            raise ValueError("a colocated engine has one pool: prefill_workers must be 1")
        for name, v in (("prefill_budget_s", prefill_budget_s), ("handoff_timeout_s", handoff_timeout_s),
                        ("link_bandwidth_Bps", link_bandwidth_Bps)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v!r}")
        if prefill_chunk_tokens is not None and (not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1):
            raise ValueError(f"prefill_chunk_tokens must be a positive integer or None, got {prefill_chunk_tokens!r}")
        if prefill_cost is not None and not callable(prefill_cost):
            raise ValueError("prefill_cost must be a callable cost(q, c) -> seconds (e.g. a PrefillCostFit)")
        self.cfg = cfg
        self.max_context = max_context or cfg.max_position_embeddings
        self.colocated = colocated
        per = len(prefill_devices) // prefill_workers
        self.prefills = [PrefillPool(params, cfg, prefill_devices[w * per:(w + 1) * per], prefill_mesh or {"expert": per})
                         for w in range(prefill_workers)]
        self.prefill = self.prefills[0]
        # colocated: the decode pool uses the prefill pool's placed params (same devices and
        # mesh: shard_params moves nothing), so the weights are on the devices once
        self.decode = DecodePool(self.prefills[0].params if colocated else params, cfg, decode_devices, decode_mesh or {"expert": len(decode_devices)},
                                 slots=max_decode_slots, block_size=block_size, max_context=self.max_context,
                                 num_blocks=num_blocks)
        self.max_prefill_attempts = max_prefill_attempts
        self.prefill_cost, self.prefill_budget_s = prefill_cost, prefill_budget_s
        self.prefill_chunk_tokens, self.handoff_timeout_s = prefill_chunk_tokens, handoff_timeout_s
        if link_bandwidth_Bps is None and not colocated:
            link_bandwidth_Bps = measure_link_bandwidth(prefill_devices[0], decode_devices[0])
        self.link_bandwidth_Bps = link_bandwidth_Bps
        # one pool: a step is either a prefill chunk or a decode step, never both at once
        self._pool_lock = FifoLock() if colocated else contextlib.nullcontext()
        self.store = None
        if prefix_cache:
            opts = {"device_blocks": 0, "host_blocks": 256, **(prefix_cache if isinstance(prefix_cache, dict) else {})}
            self.store = PrefixStore(cfg, block_size, dtype=cfg.kv_cache_dtype,
                                     device=self.prefill.replicated, **opts)
        self.fault_hooks: dict = {}     # test hooks: "handoff" -> callable(request, layer) that may raise
        self.stats: dict = {}

    # ---- prefill side --------------------------------------------------------------------
    def _cost_model(self):
        if self.prefill_cost is None:
            self.calibrate_prefill()
        return self.prefill_cost

    def _chunker(self, pool: PrefillPool | None = None):
        """What PrefillPool.run takes as ``chunk``: None, a fixed size, or chunk(position):
        the largest chunk within the budget, rounded down to whole padding buckets of the
        pool (the pool runs bucket(q) rows; at least one bucket)."""
        if self.prefill_budget_s is None:
            return self.prefill_chunk_tokens
        cost, budget, size = self._cost_model(), self.prefill_budget_s, (pool or self.prefill).size
        cap = self.prefill_chunk_tokens or self.max_context
        return lambda pos: whole_buckets(largest_chunk(cost, pos, budget, cap), size)

    def predicted_prefill_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Predicted seconds to prefill a prompt (chunk by chunk when chunking is on)."""
        cost = self._cost_model()
        plan = chunk_plan(prompt_tokens, cached_tokens, self._chunker())
        return float(sum(cost(q, c) for c, q in plan))

    def calibrate_prefill(self, shapes=None, repeats: int = 3, intercept: bool = True):
        """Measure this engine's first prefill pool on (q new tokens, c cached) shapes, through
        the same code path and chunking it serves with, and fit cost(q, c) =
        a q^2 + b q c + g q (+ d) (median of ``repeats`` after a warm-up). Sets and returns
        ``self.prefill_cost``."""
        from pdjax.analysis.costmodel_fit import fit_prefill_cost
        from pdjax.disagg.request import Request
        if shapes is None:
            top = min(256, self.max_context // 2)
            shapes = sorted({(q, c) for q in (16, 64, top) for c in (0, 64, top) if q + c <= self.max_context})
        rng = np.random.default_rng(0)
        samples = []
        for q, c in shapes:
            prompt = rng.integers(0, self.cfg.vocab_size, q + c).tolist()
            times = []
            for _ in range(repeats + 1):
                spent: list = []
                self.prefill.run(Request(0, prompt, 1), lambda *a: None,
                                 chunk=(lambda pos, c=c, q=q: c if pos == 0 and c else q), chunk_times=spent)
                times.append(spent[-1])
            samples.append((q, c, float(np.median(times[1:]))))
        self.prefill_cost = fit_prefill_cost(samples, intercept=intercept)
        self.calibration_samples = samples
        return self.prefill_cost

    def _pick_worker(self, req, free_at: list, now: float) -> int:
        """The prefill worker predicted to finish ``req`` first: its predicted free time plus
        the request's predicted cost (one worker: the only one)."""
        w, cost = 0, None
        if len(free_at) > 1:
            hit = self.store.lookup(req.prompt, peek=True) if self.store is not None else 0
            cost = self.predicted_prefill_s(len(req.prompt), hit)
            w = min(range(len(free_at)), key=lambda i: (max(free_at[i], now) + cost, i))
            free_at[w] = max(free_at[w], now) + cost
        req.prefill_worker, req.predicted_prefill_s = w, cost
        return w

    def _prefill_loop(self, pool, jobs, inbox, clock, stop, cancelled):
        try:
            self._prefill_requests(pool, jobs, inbox, clock, stop, cancelled)
        except BaseException as e:  # noqa: BLE001 - never leave the decode loop waiting
            inbox.put(_Crashed(e))

    def _prefill_requests(self, pool: PrefillPool, jobs: "queue.Queue", inbox: "queue.Queue", clock: Clock,
                          stop: threading.Event, cancelled: set):
        """One prefill worker: attempts in order (their KV blocks already reserved), each
        layer pushed to the decode rank that owns the blocks as soon as it is computed."""
        chunk = self._chunker(pool)
        while not stop.is_set():
            try:
                a = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            req, key = a.request, (a.request.index, a.number)
            if key in cancelled:                      # abandoned while queued: never started
                continue
            target = self.decode.target_device(a.res)
            inbox.put(Started(req.index, a.number, clock.now()))

            def push(l, rows, start, key=key):
                if key in cancelled:                  # abandoned while running: stop here
                    raise _Cancelled()
                hook = self.fault_hooks.get("handoff")
                if hook is not None:
                    hook(req, l)
                moved = jax.device_put(rows, target)          # asynchronous copy
                nbytes = 0 if self.colocated else rows.size * rows.dtype.itemsize
                inbox.put(LayerArrived(key[0], key[1], l, moved, start, nbytes, clock.now()))
            try:
                prefix = self._cached_prefix(req, pool)
                tok, rows = pool.run(req, push, prefix, chunk=chunk, step_lock=self._pool_lock)
            except _Cancelled:
                continue
            except Exception as e:  # noqa: BLE001 - any handoff/prefill failure retries the request
                inbox.put(Failed(req.index, a.number, f"{type(e).__name__}: {e}", clock.now()))
                continue
            inbox.put(Ready(req.index, a.number, tok, clock.now()))
            if self.store is not None:                # after ready: a store failure costs a cache entry only
                try:
                    self.store.insert(req.prompt, rows, retention=req.retention)
                except Exception as e:  # noqa: BLE001
                    req.prefix_errors.append(f"insert failed: {type(e).__name__}: {e}")

    def _cached_prefix(self, req, pool: PrefillPool):
        """(P, layer-by-layer loader) for the request's cached prefix, or None. A block that
        fails its checksum (or vanished) is dropped and the prefix recomputed."""
        if self.store is None:
            return None
        P = self.store.lookup(req.prompt)
        req.prefix_hit_tokens = 0
        if P == 0:
            return None
        try:
            loaded = self.store.load(req.prompt, P, pool.replicated)
        except (CorruptBlockError, MissingBlockError) as e:
            req.prefix_errors.append(str(e))
            return None
        req.prefix_hit_tokens = P
        return P, loaded

    # ---- decode side ---------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, retention: str = "chat", arrival_times=None):
        """Serve ``prompts``; returns their generated tokens in request order.

        ``max_new_tokens`` and ``sampling`` may be per-request lists; ``arrival_times``
        (seconds from the call, non-decreasing) releases each request to the prefill queue
        at its time instead of all at once; ``on_token(request_index, token)`` streams."""
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        arrivals = [0.0] * n if arrival_times is None else [float(a) for a in arrival_times]
        if len(arrivals) != n or any(b < a for a, b in zip(arrivals, arrivals[1:])) or min(arrivals, default=0) < 0:
            raise ValueError("arrival_times must be one non-negative, non-decreasing time per prompt")
        reqs = []
        for i, p in enumerate(prompts):
            r = Request(i, list(p) if not isinstance(p, np.ndarray) else p.tolist(), mnt[i],
                        samplings[i], tuple(stop_tokens), retention, arrival=arrivals[i])
            try:
                validate_request(r, self.cfg.vocab_size, self.max_context)
            except RequestError as e:
                r.error = e
            reqs.append(r)
        if self.prefill_cost is None and (self.prefill_budget_s is not None or len(self.prefills) > 1):
            self.calibrate_prefill()                  # once, before any thread needs it
        clock = Clock()                               # the served clock starts now
        inbox: queue.Queue = queue.Queue()
        stop = threading.Event()
        cancelled: set = set()                        # (request, attempt) the scheduler abandoned
        jobs = [queue.Queue() for _ in self.prefills]
        sched = DecodeScheduler(self.decode, max_prefill_attempts=self.max_prefill_attempts,
                                handoff_timeout_s=self.handoff_timeout_s)
        signals = Signals(self.link_bandwidth_Bps,
                          lambda: sum(q.qsize() for q in jobs) + len(sched.waiting), clock)
        threads = [threading.Thread(target=self._prefill_loop, args=(pool, q, inbox, clock, stop, cancelled),
                                    daemon=True) for pool, q in zip(self.prefills, jobs)]
        for t in threads:
            t.start()
        try:
            self._decode_loop(sched, [r for r in reqs if r.error is None], jobs, inbox, cancelled, clock,
                              on_token, signals)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        self._record_stats(reqs, clock, signals, sched)
        return [r.error if r.error is not None else list(r.output) for r in reqs]

    def _decode_loop(self, sched, arrivals, jobs, inbox, cancelled, clock, on_token, signals):
        """The driver of the scheduler in this process: releases each request at its arrival,
        feeds it the prefill workers' events and the decode steps, and carries out its
        actions (an attempt to the worker predicted to finish it first, cancellations,
        streamed tokens)."""
        upcoming = collections.deque(arrivals)
        free_at = [0.0] * len(jobs)

        def carry(actions):
            for a in actions:
                if isinstance(a, StartPrefill):
                    jobs[self._pick_worker(a.attempt.request, free_at, clock.now())].put(a.attempt)
                elif isinstance(a, CancelPrefill):
                    cancelled.add((a.request, a.attempt))
                elif isinstance(a, Admitted):
                    signals.kv_waits.append(a.request.kv_wait_s)
                elif isinstance(a, Token):
                    if on_token is not None:
                        on_token(a.request.index, a.token)

        while upcoming or sched.remaining:
            while upcoming and upcoming[0].arrival <= clock.now():
                carry(sched.handle(Submit(upcoming.popleft(), clock.now())))
            events = []
            if not sched.running:                     # idle: sleep until a message, an arrival or a deadline
                wake = min(upcoming[0].arrival if upcoming else math.inf, sched.deadline(), clock.now() + 1.0)
                try:
                    events.append(inbox.get(timeout=max(wake - clock.now(), 0.0)))
                except queue.Empty:
                    pass
            while True:
                try:
                    events.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for ev in events:
                if isinstance(ev, _Crashed):
                    raise RuntimeError("the prefill worker crashed") from ev.error
                if isinstance(ev, LayerArrived):
                    signals.bytes += ev.nbytes
                carry(sched.handle(ev))
            if self.handoff_timeout_s is not None:
                carry(sched.handle(Tick(clock.now())))
            signals.sample()
            if sched.running:
                with self._pool_lock:
                    new_tokens = self.decode.step()
                carry(sched.handle(Stepped(new_tokens, clock.now())))

    def _record_stats(self, reqs, clock, signals, sched):
        per = [r.metrics() for r in reqs]
        sent = sum(r.kv_bytes_sent for r in reqs)
        elapsed = clock.now()
        waits = [r.kv_wait_s for r in reqs if r.error is None]
        depths = [row["prefill_queue_depth"] for row in signals.rows] or [0]
        bw = self.link_bandwidth_Bps
        self.stats = {"requests": per, "kv_bytes_sent": sent, "elapsed_s": elapsed,
                      "link_throughput_Bps": sent / elapsed if elapsed > 0 else 0.0,
                      "link_bandwidth_Bps": bw,
                      "link_utilisation": sent / elapsed / bw if bw and elapsed > 0 else 0.0,
                      "prefill_queue_depth_max": max(depths),
                      "prefill_queue_depth_mean": float(np.mean(depths)),
                      "decode_kv_wait_p95_s": float(np.percentile(waits, 95)) if waits else 0.0,
                      "handoff_timeouts": sum(r.handoff_timeouts for r in reqs),
                      "stale_messages": sched.stats["stale_messages"], "pool_full": sched.stats["pool_full"],
                      "signals": signals.rows,
                      "failed": sum(r.error is not None for r in reqs)}


class ColocatedEngine(PDEngine):
    """Prefill and decode on the same devices and mesh: the same scheduler, no KV link."""

    def __init__(self, params, cfg: ModelConfig, *, devices=None, mesh=None, **kwargs):
        devices = list(devices if devices is not None else jax.devices())
        mesh = mesh or {"expert": len(devices)}
        super().__init__(params, cfg, prefill_devices=devices, decode_devices=devices, prefill_mesh=mesh,
                         decode_mesh=mesh, colocated=True, **kwargs)
