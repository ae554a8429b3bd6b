"""PD-disaggregated and colocated serving engines over real meshes.

``PDEngine``: a prefill pool and a decode pool on disjoint devices, each with its own mesh
and parallel layout (prefill: small EP; decode: DP attention + EP over a paged cache). A
prefill thread takes requests in order, waits for the decode pool to pre-allocate the KV
blocks (back-pressure when it is full), prefills layer by layer and pushes each layer's
latent rows to the decode rank that owns the blocks; the decode loop (the calling thread)
writes arriving layers into the blocks, admits a request to the running batch once all its
layers are in, and steps the batch (continuous batching: requests join and leave between
steps). A failed handoff is retried by prefilling the request again.

``ColocatedEngine``: the same scheduler with both pools on the same devices (no link); as in
a single-pool engine, a step is either a whole prefill or a decode step, so a long prefill
stalls the running decodes.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import jax
import numpy as np

from pdjax.config import ModelConfig
from pdjax.model.transformer import param_dtype
from pdjax.disagg.decode import DecodePool, Reservation
from pdjax.disagg.prefill import PrefillPool
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError, PrefixStore
from pdjax.disagg.request import Clock, Request, RequestError, SamplingParams, validate_request


class _Handoff:
    """Bookkeeping of one request's transfer, shared by the two threads."""

    def __init__(self, res: Reservation, t_reserved: float):
        self.res, self.t_reserved = res, t_reserved
        self.bytes = 0


class PDEngine:
    """Prefill/decode disaggregation. See the module docstring; ``generate`` returns one token
    list per prompt, in request order (a :class:`RequestError` in place of a bad request)."""

    def __init__(self, params, cfg: ModelConfig, *, prefill_devices, decode_devices,
                 prefill_mesh=None, decode_mesh=None, block_size: int = 16, max_decode_slots: int = 8,
                 max_context: int | None = None, num_blocks: int | None = None, prefix_cache: bool = False,
                 max_prefill_attempts: int = 3, colocated: bool = False):
        prefill_devices, decode_devices = list(prefill_devices), list(decode_devices)
        if not colocated and {d.id for d in prefill_devices} & {d.id for d in decode_devices}:
            raise ValueError("prefill_devices and decode_devices must be disjoint (use ColocatedEngine to share)")
        self.cfg = cfg
        self.max_context = max_context or cfg.max_position_embeddings
        self.colocated = colocated
        self.prefill = PrefillPool(params, cfg, prefill_devices, prefill_mesh or {"expert": len(prefill_devices)})
        self.decode = DecodePool(params, cfg, decode_devices, decode_mesh or {"expert": len(decode_devices)},
                                 slots=max_decode_slots, block_size=block_size, max_context=self.max_context,
                                 num_blocks=num_blocks)
        self.max_prefill_attempts = max_prefill_attempts
        # one pool: a step is either a prefill or a decode step, never both at once
        self._pool_lock = threading.Lock() if colocated else contextlib.nullcontext()
        self.store = None
        if prefix_cache:
            opts = {"device_blocks": 0, "host_blocks": 256, **(prefix_cache if isinstance(prefix_cache, dict) else {})}
            self.store = PrefixStore(cfg, block_size, dtype=param_dtype(params),
                                     device=self.prefill.replicated, **opts)
        self.fault_hooks: dict = {}     # test hooks: "handoff" -> callable(request, layer) that may raise
        self.stats: dict = {}

    # ---- prefill side --------------------------------------------------------------------
    def _prefill_loop(self, todo, inbox, clock, stop):
        try:
            self._prefill_requests(todo, inbox, clock, stop)
        except BaseException as e:  # noqa: BLE001 - never leave the decode loop waiting
            inbox.put(("crashed", e))

    def _prefill_requests(self, todo: "queue.Queue", inbox: "queue.Queue", clock: Clock, stop: threading.Event):
        while not stop.is_set():
            try:
                req = todo.get(timeout=0.05)
            except queue.Empty:
                continue
            while clock.now() < req.arrival and not stop.is_set():   # not arrived yet
                stop.wait(min(0.01, req.arrival - clock.now()))
            res = None
            while res is None:
                res = self.decode.reserve(req)
                if res is None:                       # decode pool full: back-pressure
                    with self.decode.lock:
                        self.decode.lock.wait(timeout=0.05)
            h = _Handoff(res, clock.now())
            req.prefill_attempts += 1
            target = self.decode.target_device(res)

            def push(l, rows, start, h=h):
                hook = self.fault_hooks.get("handoff")
                if hook is not None:
                    hook(req, l)
                moved = jax.device_put(rows, target)          # asynchronous copy
                if not self.colocated:
                    h.bytes += rows.size * rows.dtype.itemsize
                inbox.put(("layer", h, l, moved, start))
            try:
                prefix = self._cached_prefix(req)
                with self._pool_lock:
                    tok, rows = self.prefill.run(req, push, prefix)
                if self.store is not None:
                    self.store.insert(req.prompt, rows, retention=req.retention)
            except Exception as e:  # noqa: BLE001 - any handoff/prefill failure retries the request
                inbox.put(("failed", h, e))
                continue
            inbox.put(("ready", h, tok))

    def _cached_prefix(self, req):
        """(P, layer-by-layer loader) for the request's cached prefix, or None. A block that
        fails its checksum (or vanished) is dropped and the prefix recomputed."""
        if self.store is None:
            return None
        P = self.store.lookup(req.prompt)
        req.prefix_hit_tokens = 0
        if P == 0:
            return None
        try:
            loaded = self.store.load(req.prompt, P, self.prefill.replicated)
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
        clock = Clock()
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
        todo, inbox = queue.Queue(), queue.Queue()
        for r in reqs:
            if r.error is None:
                todo.put(r)
        stop = threading.Event()
        worker = threading.Thread(target=self._prefill_loop, args=(todo, inbox, clock, stop), daemon=True)
        worker.start()
        queue_depth = []
        try:
            self._decode_loop(reqs, todo, inbox, clock, on_token, queue_depth)
        finally:
            stop.set()
            worker.join(timeout=60)
        self._record_stats(reqs, clock, queue_depth)
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

    def _decode_loop(self, reqs, todo, inbox, clock, on_token, queue_depth):
        remaining = sum(r.error is None for r in reqs)
        while remaining:
            block = not self.decode.active
            try:
                msgs = [inbox.get(timeout=1.0) if block else inbox.get_nowait()]
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
                if kind == "layer":
                    self.decode.receive_layer(h.res, msg[2], msg[3], msg[4])
                elif kind == "failed":
                    self.decode.cancel(h.res)
                    if req.prefill_attempts >= self.max_prefill_attempts:
                        req.error = RequestError(f"request {req.index}: prefill/handoff failed "
                                                 f"{req.prefill_attempts} times: {msg[2]}")
                        remaining -= 1
                    else:
                        todo.put(req)                      # prefill it again
                else:                                      # "ready": all layers sent
                    req.kv_bytes_sent += h.bytes
                    if self._emit(req, msg[2], clock, on_token):
                        self.decode.cancel(h.res)
                        remaining -= 1
                        continue
                    self.decode.admit(h.res, msg[2])
                    req.kv_wait_s += clock.now() - h.t_reserved
            queue_depth.append(todo.qsize())
            if self.decode.active:
                with self._pool_lock:
                    new_tokens = self.decode.step()
                for slot, tok in new_tokens.items():
                    req = self.decode.slot_req[slot].request
                    if self._emit(req, tok, clock, on_token):
                        self.decode.release(slot)
                        remaining -= 1

    def _record_stats(self, reqs, clock, queue_depth):
        per = [r.metrics() for r in reqs]
        sent = sum(r.kv_bytes_sent for r in reqs)
        elapsed = clock.now()
        waits = [r.kv_wait_s for r in reqs if r.error is None]
        self.stats = {"requests": per, "kv_bytes_sent": sent, "elapsed_s": elapsed,
                      "link_throughput_Bps": sent / elapsed if elapsed > 0 else 0.0,
                      "prefill_queue_depth_max": max(queue_depth, default=0),
                      "prefill_queue_depth_mean": float(np.mean(queue_depth)) if queue_depth else 0.0,
                      "decode_kv_wait_p95_s": float(np.percentile(waits, 95)) if waits else 0.0,
                      "failed": sum(r.error is not None for r in reqs)}


class ColocatedEngine(PDEngine):
    """Prefill and decode on the same devices and mesh: the same scheduler, no KV link."""

    def __init__(self, params, cfg: ModelConfig, *, devices=None, mesh=None, **kwargs):
        devices = list(devices if devices is not None else jax.devices())
        mesh = mesh or {"expert": len(devices)}
        super().__init__(params, cfg, prefill_devices=devices, decode_devices=devices, prefill_mesh=mesh,
                         decode_mesh=mesh, colocated=True, **kwargs)
