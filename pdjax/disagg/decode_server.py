"""The decode role of two-process PD serving (``pdjax serve --role decode``).

:class:`DecodeServer` is the router and the continuous-batching loop: the same
:class:`~pdjax.disagg.loop.DecodeLoop` and :class:`~pdjax.disagg.scheduler.DecodeScheduler`
as the in-process engines, driven by sockets. A client's ``generate`` is validated (a bad
request fails alone, before any compute) and submitted; the scheduler's ``StartPrefill``
becomes a ``prefill`` message to the prefill process, ``CancelPrefill`` a ``cancel``. The
prefill process's messages become the scheduler's events, stamped by this process's clock;
a layer of the current attempt is pulled onto the owning rank's device by the reader
thread before it is queued (so it reaches the loop before its ``ready``); an abandoned
attempt's layer is never pulled (its offer expires).

If the prefill process dies (its control connection ends), every attempt in flight fails
(its request is prefilled again), the client is told (``prefill_lost``), and new prefill
jobs wait until the client sends the address of a restarted prefill process (``prefill``).

The messages both ways are :data:`pdjax.disagg.wire.CLIENT_DECODE` (``hello``, ``generate``,
``prefill{address}``, ``stats``; back ``token``, ``done``, ``stats{counters}``: the link's and
the scheduler's counters and what the pool holds, :meth:`DecodeServer.held`, and
``prefill_lost{why, address}``: the address of the prefill process lost; a
``prefill{address}`` while connected replaces the connection, failing what was sent there),
and :data:`pdjax.disagg.wire.DECODE_PREFILL` to the prefill process. A client's closed
connection shuts the process down.
Everything binds to ``host`` (default loopback); each pull has a deadline (``pull_timeout_s``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax

from pdjax.arguments import check_int, check_positive
from pdjax.cluster.supervisor import announce_ready
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.link import checksum
from pdjax.disagg.loop import DecodeLoop
from pdjax.disagg.prefill_server import mesh_devices, ready_info
from pdjax.disagg.clock import Clock
from pdjax.disagg.request import Request, RequestError, SamplingParams, validate_request
from pdjax.disagg.scheduler import (CancelPrefill, DecodeScheduler, Failed, Finished, LayerArrived, StartPrefill,
                                    Submit, Token)
from pdjax.cluster.messages import Channel
from pdjax.cluster.transfer import LOOPBACK, ArrayReceiver, listen, start_transfer_server
from pdjax.disagg.link import TransferLink
from pdjax.disagg.wire import CLIENT_DECODE, DECODE_PREFILL, PrefillJob, event_from_wire


class DecodeServer:
    def __init__(self, params, cfg, mesh_axes: dict, *, slots: int, block_size: int, max_context: int,
                 num_blocks: int | None = None, max_prefill_attempts: int = 3, handoff_timeout_s: float = 30.0,
                 pull_timeout_s: float = 60.0, host: str = LOOPBACK):
        for name, value in (("slots", slots), ("block_size", block_size), ("max_context", max_context),
                            ("max_prefill_attempts", max_prefill_attempts)):
            check_int(name, value)
        if num_blocks is not None:
            check_int("num_blocks", num_blocks, 2)
        check_positive("handoff_timeout_s", handoff_timeout_s)
        check_positive("pull_timeout_s", pull_timeout_s)
        self.cfg, self.max_context, self.handoff_timeout_s = cfg, max_context, handoff_timeout_s
        self.pool = DecodePool(params, cfg, mesh_devices(mesh_axes), mesh_axes, slots=slots,
                               block_size=block_size, max_context=max_context, num_blocks=num_blocks)
        self.server = start_transfer_server(jax.local_devices(), host)
        self.listener = listen(host)
        self.pull_timeout_s = pull_timeout_s
        self.clock = Clock()
        self.sched = DecodeScheduler(self.pool, max_prefill_attempts=max_prefill_attempts,
                                     handoff_timeout_s=handoff_timeout_s, checksum=checksum)
        self.loop = DecodeLoop(self.sched, self.pool, self.clock, self._carry)
        self.link: TransferLink | None = None
        self.prefill: Channel | None = None     # None: the prefill process is gone, jobs wait
        self.client: Channel | None = None
        self.unsent: list = []                  # prefill jobs waiting for a prefill process
        self.prefill_address: str | None = None
        self._generation = 0

    def serve_forever(self) -> None:
        announce_ready(ready_info("decode", self.listener, self.server.address()))
        sock, _ = self.listener.accept()
        self.client = Channel(sock, CLIENT_DECODE, "decode")
        hello = self.client.expect("hello")
        self._connect_prefill(hello["prefill"], self.loop)
        threading.Thread(target=self._read_client, daemon=True).start()
        self.loop.run(until=lambda: False)

    # ---- the prefill connection -----------------------------------------------------------
    def _connect_prefill(self, address: str, loop: DecodeLoop) -> None:
        old = self.prefill
        if old is not None:                       # replaced: what was sent there is lost with it
            self._prefill_lost(self._generation, "was replaced", loop)
            old.close()
        ctl = Channel.connect(address, DECODE_PREFILL, "decode")
        hello = ctl.expect("hello")
        receiver = ArrayReceiver(hello["transfer_address"], self.server, timeout_s=self.pull_timeout_s)
        self.link = TransferLink(receiver=receiver)
        self._generation += 1
        self.prefill, self.prefill_address = ctl, address
        threading.Thread(target=self._read_prefill, args=(ctl, self.link, self._generation), daemon=True).start()
        for msg in self.unsent:
            ctl.send(msg)
        self.unsent = []

    def _read_prefill(self, ctl: Channel, link: TransferLink, generation: int) -> None:
        """Prefill messages in order, as scheduler events on the loop's inbox. A pull that
        fails alone (past its deadline, a layout or size other than announced) fails its
        attempt, which is cancelled and prefilled again; a broken link is the prefill lost."""
        try:
            while (msg := ctl.recv()) is not None:
                event = event_from_wire(msg, self.clock.now())
                if isinstance(event, LayerArrived):      # pulled only for the current attempt
                    a = self.sched.attempts.get(event.request)
                    try:
                        rows = link.receive(event.rows, self.pool.target_device(a.res)) if self._current(msg) else None
                    except (TimeoutError, ValueError) as e:
                        ctl.send({"op": "cancel", "request": event.request, "attempt": event.attempt})
                        event = Failed(event.request, event.attempt, f"{type(e).__name__}: {e}", self.clock.now())
                    else:
                        event = dataclasses.replace(event, rows=rows)
                self.loop.post(event)
            why = "closed its control connection"
        except (OSError, ValueError) as e:
            why = f"failed: {type(e).__name__}: {e}"
        self.loop.post(functools.partial(self._prefill_lost, generation, why))

    def _prefill_lost(self, generation: int, why: str, loop: DecodeLoop) -> None:
        if generation != self._generation:
            return
        self.prefill = None
        for a in list(self.sched.attempts.values()):      # queued or running there: lost with it
            loop.handle(Failed(a.request.index, a.number, f"the prefill process {why}", self.clock.now()))
        self.unsent = [m for m in self.unsent if m["op"] == "prefill" and self._current(m)]   # its retries only
        if why != "was replaced":
            self.client.send({"op": "prefill_lost", "why": why, "address": self.prefill_address})

    def _current(self, msg: dict) -> bool:
        a = self.sched.attempts.get(msg["request"])
        return a is not None and a.number == msg["attempt"]

    # ---- the client connection ------------------------------------------------------------
    def _read_client(self) -> None:
        try:
            while (msg := self.client.recv()) is not None:
                self.loop.post(functools.partial(self._on_client, msg))
        except (OSError, ValueError):
            pass
        self.loop.post(functools.partial(self._on_client, {"op": "shutdown"}))

    def _on_client(self, msg: dict, loop: DecodeLoop) -> None:
        op = msg["op"]
        if op == "shutdown":
            loop.stopped = True
        elif op == "prefill":
            self._connect_prefill(msg["address"], loop)
        elif op == "stats":
            r = self.link.receiver
            self.client.send({"op": "stats", "counters": {
                "kv_bytes_received": r.bytes_received, "pulls": r.pulls, "pull_seconds": r.pull_seconds,
                "link_throughput_Bps": r.throughput_Bps, **self.sched.stats, **self.held()}})
        elif op == "generate":
            event = self._submit(msg)
            if isinstance(event, Request):            # bad input: fails alone, before any compute
                self._finish(event)
            else:
                loop.handle(event)

    def held(self) -> dict:
        """What the decode side holds now: ``free_blocks`` per DP rank, ``reservations``
        (blocks reserved for KV still arriving), ``running`` slots and prefill ``attempts``
        in flight (all back to idle values once every request ended: nothing leaked)."""
        pool = self.pool
        return {"free_blocks": [pool.alloc.available(k) for k in range(pool.ranks)],
                "reservations": len(pool.pending), "running": sum(r is not None for r in pool.slot_req),
                "attempts": len(self.sched.attempts)}

    def _submit(self, msg: dict):
        """A client's ``generate``: the Submit event, or the Request with the error it fails with."""
        req = Request(msg["request"], list(msg["prompt"]), msg["max_new_tokens"],
                      stop_tokens=tuple(msg.get("stop_tokens", ())))
        try:
            req.sampling = SamplingParams(**msg.get("sampling", {}))
            validate_request(req, self.cfg.vocab_size, self.max_context)
            t = msg.get("handoff_timeout_s", self.handoff_timeout_s)
            if not (isinstance(t, (int, float)) and t > 0):
                raise RequestError(f"request {req.index}: handoff_timeout_s must be > 0, got {t!r}")
        except RequestError as e:
            req.error = e
            return req
        return Submit(req, self.clock.now(), timeout_s=t,
                      options=(bool(msg.get("prefix_cache", True)), msg.get("retention", "chat")))

    # ---- the scheduler's actions ------------------------------------------------------------
    def _carry(self, actions) -> None:
        for a in actions:
            if isinstance(a, StartPrefill):
                self._to_prefill(PrefillJob.of(a.attempt).to_wire())
            elif isinstance(a, CancelPrefill):
                self._to_prefill({"op": "cancel", "request": a.request, "attempt": a.attempt})
            elif isinstance(a, Token):
                self.client.send({"op": "token", "request": a.request.index, "token": a.token})
            elif isinstance(a, Finished):
                self._finish(a.request)

    def _to_prefill(self, msg: dict) -> None:
        if self.prefill is None:                  # no prefill process now: held until one connects
            self.unsent.append(msg)
            return
        try:
            self.prefill.send(msg)
        except OSError:                           # it just died: its reader reports the loss
            self.unsent.append(msg)

    def _finish(self, req: Request) -> None:
        out = {"op": "done", "request": req.index, "kv_bytes": req.kv_bytes_sent,
               "prefill_attempts": req.prefill_attempts, "handoff_timeouts": req.handoff_timeouts,
               "prefix_hit_tokens": req.prefix_hit_tokens, "prefix_errors": list(req.prefix_errors)}
        out.update({"error": str(req.error)} if req.error else {"tokens": req.output})
        self.client.send(out)
