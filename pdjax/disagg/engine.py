"""PD-disaggregated and colocated serving engines over real meshes.

``PDEngine``: a prefill pool and a decode pool on disjoint devices, each with its own mesh
and parallel layout (prefill: small EP; decode: DP attention + EP over a paged cache). A
prefill thread takes requests in order, waits for the decode pool to pre-allocate the KV
blocks (back-pressure when it is full), prefills layer by layer and pushes each layer's
latent rows to the decode rank that owns the blocks; the decode loop (the calling thread)
writes arriving layers into the blocks, admits a request to the running batch once all its
layers are in, and steps the batch (continuous batching: requests join and leave between
steps). A failed handoff is retried by prefilling the request again; so is one that makes no
progress for ``handoff_timeout_s`` (its late layers are ignored).

Several prefill workers (``prefill_workers``: the prefill devices split into equal meshes)
share one prefix cache; a dispatcher gives each arriving request to the worker predicted to
finish it first under the prefill cost model (``prefill_cost``, a callable cost(q, c) in
seconds such as a fitted :class:`~pdjax.analysis.costmodel_fit.PrefillCostFit`; measured on
this engine's own prefill pool by :meth:`PDEngine.calibrate_prefill` when not given).
Chunked prefill: with ``prefill_budget_s`` each chunk is the largest that fits the budget
under the cost model given the tokens already cached (``prefill_chunk_tokens`` caps it, or
alone fixes it).

``ColocatedEngine``: the same scheduler with both pools on the same devices (no link); as in
a single-pool engine, a step is either a prefill chunk or a decode step (a FIFO lock lets a
waiting decode step in between chunks), so an unchunked long prefill stalls the running
decodes.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading

import jax
import numpy as np

from pdjax.config import ModelConfig
from pdjax.model.transformer import param_dtype
from pdjax.disagg.decode import DecodePool, Reservation
from pdjax.disagg.prefill import PrefillPool, chunk_plan
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError, PrefixStore
from pdjax.disagg.request import Clock, Request, RequestError, SamplingParams, validate_request
from pdjax.disagg.scheduling import FifoLock, Signals, largest_chunk, measure_link_bandwidth, whole_buckets


class _Handoff:
    """Bookkeeping of one prefill attempt's transfer, shared by the threads."""

    def __init__(self, res: Reservation, t_reserved: float):
        self.res, self.t_reserved = res, t_reserved
        self.t_progress = t_reserved          # last layer that arrived (decode side)
        self.bytes = 0
        self.abandoned = False                # timed out: its late messages are ignored


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
        self.decode = DecodePool(params, cfg, decode_devices, decode_mesh or {"expert": len(decode_devices)},
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
            self.store = PrefixStore(cfg, block_size, dtype=param_dtype(params),
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

    def _dispatch_loop(self, arrivals, retries, worker_queues, clock, stop, inbox):
        """Release each request at its arrival (``arrivals``: in arrival order; ``retries``:
        requests to prefill again, released at once) and give it to the worker predicted to
        finish it first: predicted free time of each worker + the request's predicted cost."""
        try:
            free_at = [0.0] * len(worker_queues)
            upcoming = collections.deque(arrivals)
            while not stop.is_set():
                try:
                    req = retries.get_nowait()
                except queue.Empty:
                    if not upcoming or clock.now() < upcoming[0].arrival:
                        wait = 0.05 if not upcoming else min(0.01, upcoming[0].arrival - clock.now())
                        stop.wait(max(wait, 0.0))
                        continue
                    req = upcoming.popleft()
                w, cost = 0, None
                if len(worker_queues) > 1:
                    hit = self.store.lookup(req.prompt, peek=True) if self.store is not None else 0
                    cost = self.predicted_prefill_s(len(req.prompt), hit)
                    now = clock.now()
                    w = min(range(len(free_at)), key=lambda i: (max(free_at[i], now) + cost, i))
                    free_at[w] = max(free_at[w], now) + cost
                req.prefill_worker, req.predicted_prefill_s = w, cost
                worker_queues[w].put(req)
        except BaseException as e:  # noqa: BLE001 - never leave the decode loop waiting
            inbox.put(("crashed", e))

    def _prefill_loop(self, pool, jobs, inbox, clock, stop):
        try:
            self._prefill_requests(pool, jobs, inbox, clock, stop)
        except BaseException as e:  # noqa: BLE001 - never leave the decode loop waiting
            inbox.put(("crashed", e))

    def _prefill_requests(self, pool: PrefillPool, jobs: "queue.Queue", inbox: "queue.Queue", clock: Clock,
                          stop: threading.Event):
        chunk = self._chunker(pool)
        while not stop.is_set():
            try:
                req = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            res = None
            self._signals.blocked += 1                # queued until the decode side has room
            while res is None and not stop.is_set():
                res = self.decode.reserve(req)
                if res is None:                       # decode pool full: back-pressure
                    with self.decode.lock:
                        self.decode.lock.wait(timeout=0.05)
            self._signals.blocked -= 1
            if res is None:
                return
            h = _Handoff(res, clock.now())
            req.prefill_attempts += 1
            target = self.decode.target_device(res)
            inbox.put(("start", h))

            def push(l, rows, start, h=h):
                hook = self.fault_hooks.get("handoff")
                if hook is not None:
                    hook(req, l)
                moved = jax.device_put(rows, target)          # asynchronous copy
                if not self.colocated:
                    h.bytes += rows.size * rows.dtype.itemsize
                inbox.put(("layer", h, l, moved, start))
            try:
                prefix = self._cached_prefix(req, pool)
                tok, rows = pool.run(req, push, prefix, chunk=chunk, step_lock=self._pool_lock)
            except Exception as e:  # noqa: BLE001 - any handoff/prefill failure retries the request
                inbox.put(("failed", h, e))
                continue
            inbox.put(("ready", h, tok))
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
        retries, inbox = queue.Queue(), queue.Queue()
        stop = threading.Event()
        jobs = [queue.Queue() for _ in self.prefills]
        self._signals = signals = Signals(self, jobs, clock)
        arrivals = [r for r in reqs if r.error is None]
        threads = [threading.Thread(target=self._dispatch_loop, args=(arrivals, retries, jobs, clock, stop, inbox),
                                    daemon=True)]
        threads += [threading.Thread(target=self._prefill_loop, args=(pool, q, inbox, clock, stop), daemon=True)
                    for pool, q in zip(self.prefills, jobs)]
        for t in threads:
            t.start()
        try:
            self._decode_loop(reqs, retries, inbox, clock, on_token, signals)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        self._record_stats(reqs, clock, signals)
        return [r.error if r.error is not None else list(r.output) for r in reqs]

    def _emit(self, req: Request, tok: int, clock: Clock, on_token) -> bool:
        """Record a token; True when the request is finished."""
        t = clock.now()
        req.output.append(tok)
        req.token_times.append(t)
        if req.first_token_time is None:
            req.first_token_time = t
        if on_token is not None:
            on_token(req.index, tok)
        if len(req.output) >= req.max_new_tokens or tok in req.stop_tokens:
            req.finish_time = t
            return True
        return False

    def _decode_loop(self, reqs, retries, inbox, clock, on_token, signals):
        remaining = sum(r.error is None for r in reqs)
        inflight: set = set()

        def retry(h, why):
            nonlocal remaining
            req = h.res.request
            self.decode.cancel(h.res)
            inflight.discard(h)
            if req.prefill_attempts >= self.max_prefill_attempts:
                req.error = RequestError(f"request {req.index}: prefill/handoff failed "
                                         f"{req.prefill_attempts} times: {why}")
                remaining -= 1
            else:
                retries.put(req)                   # prefill it again, ahead of later arrivals

        while remaining:
            watching = self.handoff_timeout_s is not None and inflight
            block = not self.decode.active
            try:
                msgs = [inbox.get(timeout=0.05 if watching else 1.0) if block else inbox.get_nowait()]
            except queue.Empty:
                msgs = []
            while True:
                try:
                    msgs.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in msgs:
                if msg[0] == "crashed":
                    raise RuntimeError("the prefill worker crashed") from msg[1]
                kind, h = msg[0], msg[1]
                req = h.res.request
                if h.abandoned:                            # a timed-out attempt's late message
                    continue
                if kind == "start":
                    inflight.add(h)
                elif kind == "layer":
                    self.decode.receive_layer(h.res, msg[2], msg[3], msg[4])
                    h.t_progress = clock.now()
                    if not self.colocated:
                        signals.bytes += msg[3].nbytes
                elif kind == "failed":
                    retry(h, msg[2])
                else:                                      # "ready": all layers sent
                    inflight.discard(h)
                    req.kv_bytes_sent += h.bytes
                    if self._emit(req, msg[2], clock, on_token):
                        self.decode.cancel(h.res)
                        remaining -= 1
                        continue
                    self.decode.admit(h.res, msg[2])
                    req.kv_wait_s += clock.now() - h.t_reserved
                    signals.kv_waits.append(req.kv_wait_s)
            if self.handoff_timeout_s is not None:
                now = clock.now()
                for h in [h for h in inflight if now - h.t_progress > self.handoff_timeout_s]:
                    h.abandoned = True
                    h.res.request.handoff_timeouts += 1
                    retry(h, f"no KV arrived for {self.handoff_timeout_s:g} s (handoff timed out)")
            signals.sample()
            if self.decode.active:
                with self._pool_lock:
                    new_tokens = self.decode.step()
                for slot, tok in new_tokens.items():
                    req = self.decode.slot_req[slot].request
                    if self._emit(req, tok, clock, on_token):
                        self.decode.release(slot)
                        remaining -= 1

    def _record_stats(self, reqs, clock, signals):
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
                      "signals": signals.rows,
                      "failed": sum(r.error is not None for r in reqs)}


class ColocatedEngine(PDEngine):
    """Prefill and decode on the same devices and mesh: the same scheduler, no KV link."""

    def __init__(self, params, cfg: ModelConfig, *, devices=None, mesh=None, **kwargs):
        devices = list(devices if devices is not None else jax.devices())
        mesh = mesh or {"expert": len(devices)}
        super().__init__(params, cfg, prefill_devices=devices, decode_devices=devices, prefill_mesh=mesh,
                         decode_mesh=mesh, colocated=True, **kwargs)
