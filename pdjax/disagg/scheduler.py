"""The decode side's scheduler: one state machine for every PD deployment.

A request's life on the decode side: it *waits* until the decode pool can pre-allocate every
KV block it will need (back-pressure: the pool is full), then a *prefill attempt* starts
(``StartPrefill``: the driver hands it to a prefill worker, in this process or another);
its layers *arrive* and are written into the reserved blocks; when the prefill is *ready*
(all layers in, the first token sampled) the request joins the running batch, or finishes
at once when one token was asked for; each decode step *emits* a token per running request
(or a :class:`RequestError` for a request the step failed: it ends alone);
it *ends* when it has its tokens or meets a stop token. An attempt that *fails*, or makes no
progress for ``handoff_timeout_s`` (``Tick``), is cancelled (its blocks freed, the prefill
told to stop: ``CancelPrefill``) and the request is prefilled again ahead of later arrivals,
up to ``max_prefill_attempts``; then it ends with a :class:`RequestError`, alone.

Nothing here waits, sleeps, reads a clock or moves data: events carry their time (the
driver's clock, so tests can drive time), and the scheduler answers each event with the
actions the driver must carry out. Its one read from a device: with ``checksum`` set, the
checksums of an attempt's arrived chunks, compared with the sender's at ``Ready`` (a corrupt
payload fails the attempt before the request is admitted). The in-process engines (threads) and the two-process
servers (sockets) are drivers of this one machine. Messages of an attempt that is no longer
current (timed out, failed) are counted as stale and ignored.

The pool is anything with ``reserve(request) -> reservation | None``, ``cancel(res)``,
``receive_layer(res, layer, rows, start)``, ``admit(res, first_token) -> slot``,
``release(slot)`` and ``slot_req`` (the reservation in each slot, or None), as
:class:`pdjax.disagg.decode.DecodePool` has.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Optional

from pdjax.disagg.link import checksums_to_host
from pdjax.disagg.request import Request, RequestError


# ---- events (inputs) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Submit:
    """A validated request arrives (``timeout_s``: its handoff deadline, default the
    scheduler's; ``options``: whatever the driver passes on to the prefill, e.g. prefix-cache
    use)."""
    request: Request
    t: float
    timeout_s: Optional[float] = None
    options: Any = None


@dataclasses.dataclass(frozen=True)
class Started:
    """The prefill began computing the attempt (its deadline starts)."""
    request: int
    attempt: int
    t: float


@dataclasses.dataclass(frozen=True)
class Compiling:
    """The prefill is compiling a program it has not run yet (``active``), or has finished
    (not ``active``): compile time does not count against the handoff deadline."""
    request: int
    attempt: int
    active: bool
    t: float


@dataclasses.dataclass(frozen=True)
class LayerArrived:
    """One layer's latent rows for prompt positions ``start..start+len(rows)-1``, already on
    the owning rank's device (``nbytes``: what crossed the link)."""
    request: int
    attempt: int
    layer: int
    rows: Any
    start: int
    nbytes: int
    t: float


@dataclasses.dataclass(frozen=True)
class Ready:
    """Every layer was sent; ``first_token`` sampled by the prefill. ``info``: per-request
    fields the prefill reports (``prefix_hit_tokens``, ``prefix_errors``, ``prefill_chunks``);
    ``checksums``: ``[[layer, start, a, b]]`` of every chunk sent
    (:func:`pdjax.disagg.link.checksum`), checked against what arrived."""
    request: int
    attempt: int
    first_token: int
    t: float
    info: Any = None
    checksums: Any = None


@dataclasses.dataclass(frozen=True)
class Failed:
    """The attempt failed; ``fatal``: bad input, retrying cannot help."""
    request: int
    attempt: int
    error: str
    t: float
    fatal: bool = False


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed: attempts past their deadline are abandoned."""
    t: float


@dataclasses.dataclass(frozen=True)
class Stepped:
    """A decode step's new token per running slot (a tuple of tokens, in order, where a step
    emits several: speculative decoding), or the :class:`RequestError` that ends the slot's
    request (its step failed; the other slots' tokens stand)."""
    tokens: dict
    t: float


# ---- actions (outputs) -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StartPrefill:
    """Prefill this attempt (its KV blocks are reserved on rank ``attempt.res.rank``)."""
    attempt: "Attempt"


@dataclasses.dataclass(frozen=True)
class CancelPrefill:
    """Stop computing this attempt (it was abandoned); its late messages will be ignored."""
    request: int
    attempt: int


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The request joined the running batch in ``slot`` (``request.kv_wait_s``: how long its
    blocks waited for the KV)."""
    request: Request
    slot: int


@dataclasses.dataclass(frozen=True)
class Token:
    request: Request
    token: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request ended: its tokens, or ``request.error``."""
    request: Request


@dataclasses.dataclass(eq=False)
class Attempt:
    """One prefill attempt: the reservation, when it was made, its progress."""
    request: Request
    number: int
    res: Any
    reserved_at: float
    timeout_s: Optional[float]
    options: Any = None
    last: Optional[float] = None          # last progress (start, a layer); None: queued at prefill
    compiling: bool = False               # the prefill is compiling: no deadline meanwhile
    layers: int = 0
    bytes: int = 0
    received: list = dataclasses.field(default_factory=list)   # (layer, start, checksum of what arrived)

    def deadline(self) -> float:
        """No deadline while queued behind other attempts or compiling (or without a
        timeout); then ``timeout_s`` after the start, each layer and each compile's end."""
        if self.timeout_s is None or self.last is None or self.compiling:
            return math.inf
        return self.last + self.timeout_s


class DecodeScheduler:
    """See the module docstring. ``handle(event) -> [actions]``; ``remaining``: requests
    submitted and not ended; ``stats``: counters (``handoff_timeouts``, ``stale_messages``,
    ``pool_full``: reservations refused for want of blocks or slots, i.e. back-pressure;
    ``corrupt_payloads``: attempts whose chunks arrived with another checksum than sent;
    ``malformed_payloads``: attempts a layer of which the pool refused, e.g. the wrong shape,
    dtype or device: the attempt fails and is retried, the other requests go on).

    ``checksum``: rows -> checksum of an arriving chunk (e.g. :func:`pdjax.disagg.link.checksum`;
    None: payloads are not checked); a ``Ready`` whose ``checksums`` differ from what arrived
    fails its attempt (the only host read here: one per attempt, before admission).
    ``trace``: a list to append ``(t, what, request)`` to for every action and every
    refused reservation (``"PoolFull"``), the scheduler's own record of what happened when."""

    def __init__(self, pool, *, max_prefill_attempts: int = 3, handoff_timeout_s: Optional[float] = None,
                 checksum=None, trace: Optional[list] = None):
        if not isinstance(max_prefill_attempts, int) or max_prefill_attempts < 1:
            raise ValueError(f"max_prefill_attempts must be a positive integer, got {max_prefill_attempts!r}")
        if handoff_timeout_s is not None and not handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s must be > 0 or None, got {handoff_timeout_s!r}")
        self.pool = pool
        self.max_prefill_attempts = max_prefill_attempts
        self.handoff_timeout_s = handoff_timeout_s
        self.waiting: collections.deque = collections.deque()   # (request, timeout_s, options), not reserved
        self.attempts: dict[int, Attempt] = {}                   # request index -> current attempt
        self.remaining = 0
        self.stats = {"handoff_timeouts": 0, "stale_messages": 0, "pool_full": 0, "corrupt_payloads": 0,
                      "malformed_payloads": 0}
        self._options: dict[int, tuple] = {}
        self.checksum, self.trace = checksum, trace

    # ---- the machine ---------------------------------------------------------------------
    def handle(self, event) -> list:
        out: list = []
        kind = type(event)
        if kind is Submit:
            req = event.request
            self.remaining += 1
            self._options[req.index] = (event.timeout_s if event.timeout_s is not None else self.handoff_timeout_s,
                                        event.options, event.t)
            self.waiting.append(req)
        elif kind is Tick:
            self._expire(event.t, out)
        elif kind is Stepped:
            for slot, tok in event.tokens.items():
                res = self.pool.slot_req[slot]
                if isinstance(tok, RequestError):
                    res.request.error = tok
                    self.pool.release(slot)
                    self._end(res.request, event.t, out)
                elif any(self._emit(res.request, t, event.t, out)      # (stops at the one that ends it)
                         for t in (tok if isinstance(tok, tuple) else (tok,))):
                    self.pool.release(slot)
        else:
            self._progress(event, out)
        self._reserve(event.t, out)
        if self.trace is not None:
            self.trace.extend((event.t, type(a).__name__, _index(a)) for a in out)
        return out

    def abandon(self) -> None:
        """Give back everything the pool holds for this scheduler's requests (open
        reservations, running slots): what a driver calls when it stops early (an error
        escaped its loop), so the pool is left as it was found."""
        for a in list(self.attempts.values()):
            self.pool.cancel(a.res)
        self.attempts.clear()
        for slot, res in enumerate(self.pool.slot_req):
            if res is not None:
                self.pool.release(slot)
        self.waiting.clear()

    def deadline(self) -> float:
        """The earliest deadline of the attempts in flight (inf: none)."""
        return min((a.deadline() for a in self.attempts.values()), default=math.inf)

    @property
    def running(self) -> bool:
        return any(r is not None for r in self.pool.slot_req)

    # ---- inside -----------------------------------------------------------------------------
    def _current(self, event) -> Optional[Attempt]:
        a = self.attempts.get(event.request)
        if a is None or a.number != event.attempt:
            self.stats["stale_messages"] += 1
            return None
        return a

    def _progress(self, event, out: list) -> None:
        a = self._current(event)
        if a is None:
            return
        kind = type(event)
        if kind is Started:
            a.last = event.t
        elif kind is Compiling:
            a.compiling, a.last = event.active, event.t
        elif kind is LayerArrived:
            try:
                self.pool.receive_layer(a.res, event.layer, event.rows, event.start)
            except Exception as e:  # noqa: BLE001 - a malformed payload fails its attempt, not the batch
                self.stats["malformed_payloads"] += 1
                out.append(CancelPrefill(a.request.index, a.number))
                self._retry(a, f"malformed layer payload: {type(e).__name__}: {e}", event.t, out)
                return
            if self.checksum is not None:
                a.received.append((event.layer, event.start, self.checksum(event.rows)))
            a.request.kv_bytes_sent += event.nbytes
            a.bytes += event.nbytes
            a.last, a.layers = event.t, a.layers + 1
        elif kind is Failed:
            self._retry(a, event.error, event.t, out, fatal=event.fatal)
        elif kind is Ready:
            bad = self._corrupt(a, event.checksums)
            if bad:
                self.stats["corrupt_payloads"] += 1
                self._retry(a, bad, event.t, out)
                return
            del self.attempts[event.request]
            req = a.request
            for k, v in (event.info or {}).items():
                setattr(req, k, v)
            if self._emit(req, event.first_token, event.t, out):
                self.pool.cancel(a.res)
            else:
                slot = self.pool.admit(a.res, event.first_token)
                req.kv_wait_s += event.t - a.reserved_at
                out.append(Admitted(req, slot))
        else:
            raise TypeError(f"unknown scheduler event {event!r}")

    def _corrupt(self, a: Attempt, sent) -> Optional[str]:
        """Why the chunks that arrived are not the chunks sent, or None (also when unchecked)."""
        if sent is None or self.checksum is None:
            return None
        got = {(l, s): (x, y) for l, s, x, y in checksums_to_host(a.received)}
        for l, s, x, y in sent:
            if got.pop((l, s), None) != (x, y):
                return f"corrupt layer payload: layer {l} rows from {s} arrived with another checksum than sent"
        return f"layer {next(iter(got))[0]} arrived but was never sent" if got else None

    def _expire(self, now: float, out: list) -> None:
        for a in [a for a in self.attempts.values() if now > a.deadline()]:
            self.stats["handoff_timeouts"] += 1
            a.request.handoff_timeouts += 1
            out.append(CancelPrefill(a.request.index, a.number))
            self._retry(a, f"handoff of attempt {a.number} made no progress for {a.timeout_s:g} s "
                           "(handoff timed out)", now, out)

    def _retry(self, a: Attempt, why: str, now: float, out: list, fatal: bool = False) -> None:
        del self.attempts[a.request.index]
        self.pool.cancel(a.res)
        req = a.request
        if fatal:                                 # bad input: retrying cannot help
            req.error = RequestError(why)
        elif req.prefill_attempts >= self.max_prefill_attempts:
            req.error = RequestError(f"request {req.index}: prefill/handoff failed {req.prefill_attempts} "
                                     f"times: {why}")
        req.kv_bytes_sent -= a.bytes              # counted for the attempt that completes only
        if req.error is None:
            self.waiting.appendleft(req)          # ahead of later arrivals
            return
        self._end(req, now, out)

    def _reserve(self, now: float, out: list) -> None:
        """Pre-allocate the KV blocks of waiting requests, in order, while the pool has room."""
        while self.waiting:
            res = self.pool.reserve(self.waiting[0])
            if res is None:                        # full: back-pressure until a release
                self.stats["pool_full"] += 1
                if self.trace is not None:
                    self.trace.append((now, "PoolFull", self.waiting[0].index))
                return
            req = self.waiting.popleft()
            req.prefill_attempts += 1
            timeout_s, options, submitted = self._options[req.index]
            if req.prefill_attempts == 1:
                req.reserve_wait_s = now - submitted
            a = self.attempts[req.index] = Attempt(req, req.prefill_attempts, res, now, timeout_s, options)
            out.append(StartPrefill(a))

    def _emit(self, req: Request, tok: int, now: float, out: list) -> bool:
        """Record a token; True when the request ended with it."""
        tok = int(tok)
        req.output.append(tok)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        out.append(Token(req, tok))
        if len(req.output) >= req.max_new_tokens or tok in req.stop_tokens:
            self._end(req, now, out)
            return True
        return False

    def _end(self, req: Request, now: float, out: list) -> None:
        if req.error is None:
            req.finish_time = now
        self._options.pop(req.index, None)
        self.remaining -= 1
        out.append(Finished(req))


def _index(action) -> int:
    """The request index an action is about."""
    r = action.attempt.request if isinstance(action, StartPrefill) else action.request
    return r if isinstance(r, int) else r.index
