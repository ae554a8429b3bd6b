"""The prefill side of an attempt, whatever drives it: one copy for the in-process engines'
worker threads and the prefill process of serving across processes.

:class:`PrefillWorker.run` takes a :class:`PrefillJob` (what the decode scheduler's
``StartPrefill`` asks for: the prompt, the attempt, the decode rank that reserved its
blocks), and reports to the decode side through ``emit``: ``Started``, ``Compiling`` around
each program the pool compiles (compile time is not handoff time), one ``LayerArrived``
per chunk sent on the link (the payload the link returned), then ``Ready`` (first token,
prefix-cache info, the checksums of every chunk sent) or ``Failed``. A cached prefix
(``store``) is loaded layer by layer; a block that fails its checksum (or vanished) is
dropped and the prefix recomputed. After ``Ready`` the prompt's full blocks go into the
store (a store failure costs a cache entry only).
"""

from __future__ import annotations

import threading

from pdjax.disagg.link import Cancelled, KVChunk, checksum, checksums_to_host
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError
from pdjax.disagg.request import Request
from pdjax.disagg.scheduler import Compiling, Failed, LayerArrived, Ready, Started
from pdjax.disagg.wire import PrefillJob


class PrefillWorker:
    """Runs prefill jobs on ``pool`` (a :class:`~pdjax.disagg.prefill.PrefillPool`), sending
    each layer's rows on ``link``. ``chunk``: what ``PrefillPool.run`` takes (None, a size,
    or chunk(position)); ``step_lock``: held around each chunk's compute (a colocated engine; None: none);
    ``clock``: stamps the events (``now()``); ``timeline``: a
    :class:`~pdjax.disagg.device_spans.DeviceSpans` recording each layer's compute and each chunk's
    copy (when the link's payload is an array), issued and ready."""

    def __init__(self, pool, link, clock, *, store=None, chunk=None, step_lock=None, timeline=None):
        self.pool, self.link, self.clock, self.store, self.timeline = pool, link, clock, store, timeline
        self.chunk, self.step_lock = chunk, step_lock
        self._cancelled: set = set()
        self._lock = threading.Lock()
        self.insert_errors: list = []          # prefix-store inserts that failed (after Ready)

    def cancel(self, request: int, attempt: int) -> None:
        """The decode side abandoned the attempt: it never starts if queued, stops at its next
        layer if running, and a send of it in progress may give up (``link.cancel``)."""
        with self._lock:
            self._cancelled.add((request, attempt))
        self.link.cancel(request, attempt)

    def cancelled(self, request: int, attempt: int) -> bool:
        with self._lock:
            return (request, attempt) in self._cancelled

    def run(self, job: PrefillJob, emit) -> None:
        """Prefill ``job``, reporting through ``emit(event)``. A failure is reported as
        ``Failed`` (the decode side retries); only a BaseException that is not an Exception
        (the worker itself dying) propagates."""
        if self.cancelled(job.request, job.attempt):          # abandoned while queued
            with self._lock:
                self._cancelled.discard((job.request, job.attempt))
            return
        use_store = self.store is not None and job.use_store
        if use_store and job.retention not in self.store.retention:   # bad input: before any compute
            emit(Failed(job.request, job.attempt, f"request {job.request}: unknown retention class "
                        f"{job.retention!r}; known: {sorted(self.store.retention)}", self.clock.now(), fatal=True))
            return
        req = Request(job.request, list(job.prompt), 1, job.sampling)
        sums: list = []

        def push(layer, rows, start):
            if self.cancelled(job.request, job.attempt):      # abandoned while running: stop here
                raise Cancelled()
            sums.append((layer, start, checksum(rows)))
            payload, nbytes = self.link.send(KVChunk(job.request, job.attempt, layer, start, rows, job.rank))
            if self.timeline is not None and hasattr(payload, "block_until_ready"):
                self.timeline.record("kv transfer", f"layer {layer}", payload)
            emit(LayerArrived(job.request, job.attempt, layer, payload, start, nbytes, self.clock.now()))
        try:
            emit(Started(job.request, job.attempt, self.clock.now()))
            prefix = self._cached_prefix(req) if use_store else None
            tok, rows = self.pool.run(req, push, prefix, chunk=self.chunk, step_lock=self.step_lock,
                                      timeline=self.timeline, on_compile=lambda active: emit(
                                          Compiling(job.request, job.attempt, active, self.clock.now())))
            info = {"prefix_hit_tokens": req.prefix_hit_tokens, "prefix_errors": list(req.prefix_errors),
                    "prefill_chunks": list(req.prefill_chunks)}
            if req.mtp_draft is not None:
                info["mtp_draft"] = req.mtp_draft
            emit(Ready(job.request, job.attempt, tok, self.clock.now(), info, checksums_to_host(sums)))
        except Cancelled:
            return
        except Exception as e:  # noqa: BLE001 - any prefill/link failure: the decode side retries
            emit(Failed(job.request, job.attempt, f"{type(e).__name__}: {e}", self.clock.now()))
            return
        finally:
            with self._lock:
                self._cancelled.discard((job.request, job.attempt))
        if use_store:
            try:
                self.store.insert(req.prompt, rows, retention=job.retention)
            except Exception as e:  # noqa: BLE001 - the request is served; only the cache misses out
                self.insert_errors.append(f"request {job.request}: {type(e).__name__}: {e}")

    def _cached_prefix(self, req: Request):
        """(P, layer-by-layer loader) of the request's cached prefix, or None."""
        P = self.store.lookup(req.prompt)
        if P == 0:
            return None
        try:
            loaded = self.store.load(req.prompt, P, self.pool.replicated)
        except (CorruptBlockError, MissingBlockError) as e:
            req.prefix_errors.append(str(e))
            return None
        req.prefix_hit_tokens = P
        return P, loaded
