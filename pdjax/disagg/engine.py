"""PD-disaggregated and colocated serving engines over real meshes.

``PDEngine``: a prefill pool and a decode pool on disjoint devices, each with its own mesh
and parallel layout (prefill: small EP; decode: DP attention + EP over a paged cache). The
decode loop (the calling thread) drives the decode scheduler
(:class:`pdjax.disagg.scheduler.DecodeScheduler`, the state machine every PD deployment
shares): it releases each request at its arrival; the scheduler pre-allocates its KV blocks
on a decode rank (back-pressure when the pool is full) and starts a prefill attempt, which
this driver gives to the prefill worker predicted to finish it first; the worker prefills
layer by layer (:class:`~pdjax.disagg.worker.PrefillWorker`) and sends each layer's latent
rows on the engine's ``link`` (:class:`~pdjax.disagg.link.DevicePutLink`; tests wrap it to
inject faults) to the decode rank that owns the blocks;
the scheduler writes arriving layers into the blocks, admits a request to the running batch
once its prefill is ready, and the loop steps the batch (continuous batching: requests join
and leave between steps). A failed attempt is prefilled again; so is one that makes no
progress for ``handoff_timeout_s`` (the worker stops it at its next layer; late layers are
ignored); so is one whose payload arrived with another checksum than sent, and one whose
worker died (the worker is restarted). ``generate(clock=...)`` takes the clock that stamps
every event and drives the deadlines (fault tests drive it by hand).

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

import jax
import numpy as np

from pdjax.arguments import check_int, check_positive
from pdjax.model_config import ModelConfig
from pdjax.model.mtp import check_speculative
from pdjax.disagg.clock import Clock
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.link import DevicePutLink, checksum
from pdjax.disagg.loop import FifoLock
from pdjax.disagg.prefill import PrefillPool, chunk_plan
from pdjax.disagg.prefix_store import PrefixStore
from pdjax.disagg.request import Request, RequestError, SamplingParams, check_arrivals, validate_request
from pdjax.disagg.scheduler import DecodeScheduler, Submit
from pdjax.disagg.chunking import largest_chunk, whole_buckets
from pdjax.disagg.signals import measure_link_bandwidth
from pdjax.disagg.drivers import EngineRun


def _check_options(prefill_devices, decode_devices, colocated, prefill_workers, prefill_cost, prefill_chunk_tokens,
                   **positive):
    """Raise ValueError naming the first bad engine option (before anything is built)."""
    if not colocated and {d.id for d in prefill_devices} & {d.id for d in decode_devices}:
        raise ValueError("prefill_devices and decode_devices must be disjoint (use ColocatedEngine to share)")
    if not isinstance(prefill_workers, int) or prefill_workers < 1 or len(prefill_devices) % prefill_workers:
        raise ValueError(f"prefill_workers={prefill_workers!r} must be a positive integer dividing the "
                         f"{len(prefill_devices)} prefill devices")
    if colocated and prefill_workers != 1:
        raise ValueError("a colocated engine has one pool: prefill_workers must be 1")
    for name, v in positive.items():
        if v is not None:
            check_positive(name, v)
    if prefill_chunk_tokens is not None and (not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1):
        raise ValueError(f"prefill_chunk_tokens must be a positive integer or None, got {prefill_chunk_tokens!r}")
    if prefill_cost is not None and not callable(prefill_cost):
        raise ValueError("prefill_cost must be a callable cost(q, c) -> seconds (e.g. a PrefillCostFit)")


def _check_call(cfg: ModelConfig, stop_tokens, retention, store) -> None:
    """The arguments of a generate call that hold for every request (raised, not per request)."""
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (list, tuple, np.ndarray)):
        raise TypeError(f"stop_tokens must be a list of token ids, got {stop_tokens!r}")
    for t in stop_tokens:
        check_int("stop_tokens entry", t, 0, cfg.vocab_size - 1)
    if not isinstance(retention, str):
        raise TypeError(f"retention must be a retention class name, got {retention!r}")
    if store is not None and retention not in store.retention:
        raise ValueError(f"retention class {retention!r} is unknown; known: {sorted(store.retention)}")


class Engine:
    """What :class:`PDEngine`, :class:`ColocatedEngine` and :class:`pdjax.disagg.AFDEngine`
    share: the pools, the scheduler's driver and ``generate``, which returns one token list
    per prompt, in request order (a :class:`RequestError` in place of a bad request). Build
    one of those three; ``colocated`` says whether both pools share the devices."""

    def __init__(self, params, cfg: ModelConfig, *, prefill_devices, decode_devices, colocated: bool,
                 prefill_mesh=None, decode_mesh=None, block_size: int = 16, max_decode_slots: int = 8,
                 max_context: int | None = None, num_blocks: int | None = None, prefix_cache: bool = False,
                 max_prefill_attempts: int = 3, prefill_workers: int = 1,
                 prefill_cost=None, prefill_budget_s: float | None = None,
                 prefill_chunk_tokens: int | None = None, handoff_timeout_s: float | None = None,
                 link_bandwidth_Bps: float | None = None, speculative: str | None = None):
        prefill_devices, decode_devices = list(prefill_devices), list(decode_devices)
        check_speculative(params, cfg, speculative)
        for name, value, optional in (("block_size", block_size, False), ("max_decode_slots", max_decode_slots, False),
                                      ("max_prefill_attempts", max_prefill_attempts, False),
                                      ("max_context", max_context, True), ("num_blocks", num_blocks, True)):
            if not (optional and value is None):
                check_int(name, value)
        _check_options(prefill_devices, decode_devices, colocated, prefill_workers, prefill_cost,
                       prefill_chunk_tokens, prefill_budget_s=prefill_budget_s, handoff_timeout_s=handoff_timeout_s,
                       link_bandwidth_Bps=link_bandwidth_Bps)
        self.cfg = cfg
        self.max_context = cfg.max_position_embeddings if max_context is None else max_context
        self.colocated = colocated
        per = len(prefill_devices) // prefill_workers
        self.speculative = speculative
        self.prefills = [PrefillPool(params, cfg, prefill_devices[w * per:(w + 1) * per],
                                     prefill_mesh or {"expert": per}, speculative)
                         for w in range(prefill_workers)]
        self.prefill = self.prefills[0]
        # colocated: the decode pool uses the prefill pool's placed params (same devices and
        # mesh: shard_params moves nothing), so the weights are on the devices once
        self.decode = self._decode_pool(self.prefills[0].params if colocated else params, cfg, decode_devices,
                                        decode_mesh or {"expert": len(decode_devices)}, slots=max_decode_slots,
                                        block_size=block_size, max_context=self.max_context, num_blocks=num_blocks,
                                        speculative=speculative)
        self.max_prefill_attempts = max_prefill_attempts
        self.prefill_cost, self.prefill_budget_s = prefill_cost, prefill_budget_s
        self.prefill_chunk_tokens, self.handoff_timeout_s = prefill_chunk_tokens, handoff_timeout_s
        if link_bandwidth_Bps is None and not colocated:
            link_bandwidth_Bps = measure_link_bandwidth(prefill_devices[0], decode_devices[0])
        self.link_bandwidth_Bps = link_bandwidth_Bps
        # one pool: a step is either a prefill chunk or a decode step, never both at once
        self._pool_lock = FifoLock() if colocated else None
        self.store = None
        if prefix_cache:
            opts = {"device_blocks": 0, "host_blocks": 256, **(prefix_cache if isinstance(prefix_cache, dict) else {})}
            self.store = PrefixStore(cfg, block_size, dtype=cfg.kv_cache_dtype, device=self.prefill.replicated,
                                     layers=self.decode.cache_layers, **opts)
        # the KV link (tests wrap it to inject faults); colocated: nothing crosses a link
        self.link = DevicePutLink(self.decode.rank_devices, count_bytes=not colocated)
        self.timeline = None            # a DeviceSpans: record the prefill compute and KV copies of generate
        self.stats: dict = {}

    def _decode_pool(self, params, cfg: ModelConfig, devices, mesh_axes: dict, **options) -> DecodePool:
        """The decode pool the scheduler drives (an engine may serve with a DecodePool variant)."""
        return DecodePool(params, cfg, devices, mesh_axes, **options)

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
        a q^2 + b q c + g q (+ d) (median of ``repeats`` after a warm-up round;
        :func:`pdjax.analysis.costmodel_calibrate.calibrate_cost`). Sets and returns
        ``self.prefill_cost``; ``self.calibration`` is the full result."""
        from pdjax.analysis.costmodel_calibrate import FitSpec, calibrate_cost
        if shapes is None:
            top = min(256, self.max_context // 2)
            shapes = sorted({(q, c) for q in (16, 64, top) for c in (0, 64, top) if q + c <= self.max_context})
        shapes = [tuple(s) for s in shapes]
        rng = np.random.default_rng(0)
        prompts = {s: rng.integers(0, self.cfg.vocab_size, s[0] + s[1]).tolist() for s in dict.fromkeys(shapes)}

        def measure(shape):                   # seconds of the last chunk: q over a cached prefix of c
            q, c = shape
            spent: list = []
            self.prefill.run(Request(0, prompts[shape], 1), lambda *a: None,
                             chunk=lambda pos: c if pos == 0 and c else q, chunk_times=spent)
            return spent[-1]
        self.calibration = calibrate_cost(measure, shapes, repeats, fit=FitSpec("prefill", intercept=intercept),
                                          warmup=1, backend=jax.default_backend())
        self.prefill_cost, self.calibration_samples = self.calibration.fit, list(self.calibration.samples)
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

    # ---- serving ---------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens=16, *, sampling: SamplingParams | list | None = None,
                 stop_tokens=(), on_token=None, retention: str = "chat", arrival_times=None, clock=None):
        """Serve ``prompts``; returns their generated tokens in request order.

        ``max_new_tokens`` and ``sampling`` may be per-request lists; ``arrival_times``
        (seconds from the call, non-decreasing) releases each request to the prefill queue
        at its time instead of all at once; ``on_token(request_index, token)`` streams.
        ``clock``: the served clock (``now()`` in seconds; default: real time from the call),
        which stamps every event and drives the handoff deadlines."""
        reqs = self._requests(prompts, max_new_tokens, sampling, stop_tokens, retention, arrival_times)
        if self.prefill_cost is None and (self.prefill_budget_s is not None or len(self.prefills) > 1):
            self.calibrate_prefill()                  # once, before any thread needs it
        clock = clock or Clock()
        counts = self.decode.spec_counts.copy()
        sched = DecodeScheduler(self.decode, max_prefill_attempts=self.max_prefill_attempts,
                                handoff_timeout_s=self.handoff_timeout_s, checksum=checksum, trace=[])
        run = EngineRun(self, sched, clock, on_token)
        try:
            run.loop.run([Submit(r, r.arrival, options=(True, retention)) for r in reqs if r.error is None])
        finally:
            run.stop()
            sched.abandon()                           # an error escaped: leave no block or slot held
        self._record_stats(reqs, clock, run.signals, sched)
        self.stats.update(worker_restarts=run.restarts, trace=sched.trace,
                          prefix_insert_errors=[e for w in run.workers for e in w.insert_errors],
                          **_spec_stats(*(self.decode.spec_counts - counts)))
        return [r.error if r.error is not None else list(r.output) for r in reqs]

    def _requests(self, prompts, max_new_tokens, sampling, stop_tokens, retention, arrival_times) -> list:
        """One Request per prompt, validated (a bad one carries its RequestError)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple, np.ndarray)):
            raise TypeError(f"prompts must be a list of prompts (token id lists), got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        _check_call(self.cfg, stop_tokens, retention, self.store)
        if not isinstance(max_new_tokens, list):    # one for every request (a list: each its own)
            check_int("max_new_tokens", max_new_tokens)
        n = len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        mnt = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n
        arrivals = check_arrivals(arrival_times, n)
        reqs = []
        for i, p in enumerate(prompts):
            r = Request(i, p.tolist() if isinstance(p, np.ndarray) else list(p) if isinstance(p, (list, tuple)) else p,
                        mnt[i],
                        samplings[i], tuple(stop_tokens), retention, arrival=arrivals[i])
            try:
                validate_request(r, self.cfg.vocab_size, self.max_context)
            except RequestError as e:
                r.error = e
                if not isinstance(r.prompt, list):
                    r.prompt = []                 # not a sequence: nothing to count in its metrics
            reqs.append(r)
        return reqs

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
                      **{k: v for k, v in sched.stats.items() if k != "handoff_timeouts"},
                      "signals": signals.rows,
                      "failed": sum(r.error is not None for r in reqs)}


def _spec_stats(drafts: int, accepted: int) -> dict:
    """The speculative-decoding keys of ``engine.stats`` (as ``pdjax.generate``'s stats):
    ``accept_rate`` (None without drafts), ``tokens_per_step`` (tokens a decode step emitted
    per running request, before a finished request's overshoot is cut; 1.0 without drafts),
    ``drafts`` (drafts verified) and ``accepted``."""
    drafts, accepted = int(drafts), int(accepted)
    return {"accept_rate": accepted / drafts if drafts else None,
            "tokens_per_step": (drafts + accepted) / drafts if drafts else 1.0,
            "drafts": drafts, "accepted": accepted}


class PDEngine(Engine):
    """Prefill/decode disaggregation: a prefill pool and a decode pool on disjoint devices,
    layers handed over the KV link. See the module docstring and :class:`Engine`; every
    keyword of :class:`Engine` but ``colocated`` (that is :class:`ColocatedEngine`)."""

    def __init__(self, params, cfg: ModelConfig, *, prefill_devices, decode_devices, **kwargs):
        _no_colocated_option("PDEngine", kwargs)
        super().__init__(params, cfg, prefill_devices=prefill_devices, decode_devices=decode_devices,
                         colocated=False, **kwargs)


class ColocatedEngine(Engine):
    """Prefill and decode on the same devices and mesh: the same scheduler, no KV link."""

    def __init__(self, params, cfg: ModelConfig, *, devices=None, mesh=None, **kwargs):
        _no_colocated_option("ColocatedEngine", kwargs)
        devices = list(devices if devices is not None else jax.devices())
        mesh = mesh or {"expert": len(devices)}
        super().__init__(params, cfg, prefill_devices=devices, decode_devices=devices, prefill_mesh=mesh,
                         decode_mesh=mesh, colocated=True, **kwargs)


def _no_colocated_option(name: str, kwargs: dict) -> None:
    if "colocated" in kwargs:
        raise TypeError(f"{name} takes no colocated option: the engine's class says it (PDEngine: "
                        "disjoint pools; ColocatedEngine(params, cfg, devices=...): one pool)")
