"""Two-process PD serving: the prefill and the decode role (``pdjax serve --role ...``), each
a process on its own CPU devices with the same params ``(preset, seed)``, the latent KV moved
layer by layer with ``jax.experimental.transfer`` (:mod:`pdjax.disagg.transfer`). The client
and launcher, ``TwoProcessServer`` / ``launch_two_process`` (re-exported here), are in
:mod:`pdjax.disagg.launcher`.

- **prefill** (:class:`PrefillServer`) runs its decode connections' ``prefill`` messages one
  at a time, in order: a cached prefix (``--prefix-cache``: a PrefixStore) is loaded layer by
  layer (a block failing its checksum is recomputed, and reported), the rest computed layer
  by layer; layer l's rows ``[T, C+R]`` of the whole prompt are offered and announced as soon
  as layer l is dispatched (the pull overlaps layer l+1's compute); then ``ready`` with the
  first token; then the prompt's full blocks go into the store.
- **decode** (:class:`DecodeServer`) is the router and the continuous-batching loop: a
  ``generate`` is validated, its blocks reserved (back-pressure when full), then sent to
  prefill as attempt k; the current attempt's layers are pulled onto the owning rank and
  written into the paged cache; on ``ready`` the request joins the batch. An attempt without
  progress for ``--handoff-timeout`` s (counted from its ``started``, then from each layer; an
  attempt still queued behind others at prefill has no deadline) is abandoned: reservation
  cancelled, ``cancel`` sent (prefill drops it if queued, stops it at its next layer if
  running), request prefilled again, retries ahead of new requests (``--max-prefill-attempts``
  in all). The abandoned attempt's messages are ignored, its layers never pulled (the offers
  expire, KVSender ttl).

Control messages (JSON, :class:`~pdjax.disagg.transfer.Control`):
client->decode ``hello{prefill}``, ``generate{request, prompt, max_new_tokens, sampling,
stop_tokens[, handoff_timeout_s, prefix_cache, retention]}``, ``stats``, ``shutdown``; decode->prefill
``prefill{request, attempt, prompt, sampling, prefix_cache, retention}``, ``cancel{request, attempt}``;
prefill->decode ``hello{transfer_address}``, ``started{request, attempt}``,
``layer{request, attempt, layer, start, uuid, shape, dtype,
nbytes}``, ``ready{request, attempt, first_token, prefix_hit_tokens, prefix_errors}``,
``failed{request, attempt, error[, fatal]}``; decode->client ``token{request, token}``,
``done{request, tokens | error, kv_bytes, prefill_attempts, handoff_timeouts,
prefix_hit_tokens, prefix_errors}``, ``stats{...}``. Test hook, client->prefill on a
connection of its own: ``fault{prompt, stall_layer, seconds[, count]}`` (stall until the
prompt is sent again, at most that long) or
``fault{corrupt_prefix}``, answered ``fault{ok[, error]}``
(:meth:`~pdjax.disagg.launcher.TwoProcessServer.inject_prefill_fault`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import queue
import threading
import time
import traceback

import jax

from pdjax.configs import preset as config_preset
from pdjax.disagg.decode import DecodePool
from pdjax.disagg.launcher import (PrefillFaults, TwoProcessServer, announce_ready, exit_when_orphaned,
                                   launch_two_process)
from pdjax.disagg.prefill import PrefillPool
from pdjax.disagg.prefix_store import CorruptBlockError, MissingBlockError, PrefixStore
from pdjax.disagg.request import Request, RequestError, SamplingParams, validate_request
from pdjax.disagg.scheduler import (CancelPrefill, DecodeScheduler, Failed, Finished, LayerArrived, Ready, Started,
                                    StartPrefill, Stepped, Submit, Tick, Token)
from pdjax.disagg.transfer import Control, KVReceiver, KVSender, listen, start_transfer_server
from pdjax.model.transformer import init_params

__all__ = ["DecodeServer", "PrefillServer", "TwoProcessServer", "build_parser", "launch_two_process", "main"]


def _mesh_devices(mesh_axes: dict):
    n = math.prod(mesh_axes.values())
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"mesh {mesh_axes} needs {n} devices, this process has {len(devices)}")
    return devices[:n]


# ---- prefill role --------------------------------------------------------------------------
class PrefillServer:
    """``prefix_cache``: None or PrefixStore options (default 0 device, 256 host blocks)."""

    def __init__(self, params, cfg, mesh_axes: dict, *, block_size: int = 16, prefix_cache: dict | None = None):
        self.pool = PrefillPool(params, cfg, _mesh_devices(mesh_axes), mesh_axes)
        self.store = None
        if prefix_cache is not None:
            self.store = PrefixStore(cfg, block_size, dtype=cfg.kv_cache_dtype, device=self.pool.replicated,
                                     **{"device_blocks": 0, "host_blocks": 256, **prefix_cache})
        self.sender = KVSender(start_transfer_server(jax.local_devices()))
        self.listener = listen()
        self.jobs: queue.Queue = queue.Queue()
        self.faults = PrefillFaults()           # test hooks, armed by "fault" messages
        self.cancelled: set = set()             # (request, attempt) abandoned by decode

    def serve_forever(self) -> None:
        announce_ready("prefill", self.listener, self.sender.address)
        threading.Thread(target=self._accept, daemon=True).start()
        while True:
            ctl, msg = self.jobs.get()
            if msg is None:
                return
            if not ctl.closed:
                self._prefill(ctl, msg)

    def _accept(self) -> None:
        while True:
            sock, _ = self.listener.accept()
            ctl = Control(sock)
            try:
                ctl.send({"op": "hello", "transfer_address": self.sender.address})
            except OSError:
                continue
            threading.Thread(target=self._read, args=(ctl,), daemon=True).start()

    def _read(self, ctl: Control) -> None:
        try:
            while (msg := ctl.recv()) is not None:
                if msg["op"] == "fault":
                    ctl.send(self.faults.arm(msg, self.store))
                    continue
                if msg["op"] == "cancel":             # at once: the attempt may be queued or running
                    self.cancelled.add((msg["request"], msg["attempt"]))
                    continue
                if msg["op"] == "prefill":
                    self.faults.notice(msg["prompt"])
                self.jobs.put((ctl, None if msg["op"] == "shutdown" else msg))
        except (OSError, ValueError):
            pass
        ctl.closed = True               # its queued jobs are dropped; its offers expire

    def _cached_prefix(self, req):
        """(P, layer-by-layer loader) of the request's cached prefix, or None. A block that
        fails its checksum (or vanished) is dropped and the prefix recomputed (as PDEngine)."""
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

    def _prefill(self, ctl: Control, msg: dict) -> None:
        tag = {"request": msg["request"], "attempt": msg.get("attempt", 0)}
        key = (tag["request"], tag["attempt"])
        if key in self.cancelled:                 # abandoned while queued: never started
            self.cancelled.discard(key)
            return
        req = Request(msg["request"], [int(t) for t in msg["prompt"]], 1, SamplingParams(**msg["sampling"]))
        use_store = self.store is not None and msg.get("prefix_cache", True)
        retention = msg.get("retention", "chat")
        if use_store and retention not in self.store.retention:   # bad input: fail before any compute
            ctl.send({"op": "failed", **tag, "fatal": True, "error": f"request {req.index}: unknown retention "
                      f"class {retention!r}; known: {sorted(self.store.retention)}"})
            return
        stall = self.faults.take_stall(req.prompt)

        def push(layer, rows, start):
            if stall is not None and layer == stall[0]:
                stall[2].wait(stall[1])
            if key in self.cancelled:             # abandoned while running: stop here
                raise _Cancelled()
            ctl.send({"op": "layer", **tag, "layer": layer, "start": start, **self.sender.offer(rows)})
        try:
            ctl.send({"op": "started", **tag})    # decode's deadline for this attempt starts now
            prefix = self._cached_prefix(req) if use_store else None
            tok, rows = self.pool.run(req, push, prefix)
            ctl.send({"op": "ready", **tag, "first_token": tok, "prefix_hit_tokens": req.prefix_hit_tokens,
                      "prefix_errors": req.prefix_errors})
        except OSError:                 # the decode process went away
            ctl.closed = True
            return
        except _Cancelled:
            self.cancelled.discard(key)
            return
        except Exception as e:  # noqa: BLE001 - reported to decode, which retries the request
            try:
                ctl.send({"op": "failed", **tag, "error": f"{type(e).__name__}: {e}"})
            except OSError:
                ctl.closed = True
            return
        if use_store:
            try:
                self.store.insert(req.prompt, rows, retention=retention)
            except Exception:  # noqa: BLE001 - the request is served; only the cache misses out
                traceback.print_exc()


class _Cancelled(Exception):
    """An attempt decode abandoned: stop computing it, send nothing more."""


# ---- decode role ---------------------------------------------------------------------------
class DecodeServer:
    def __init__(self, params, cfg, mesh_axes: dict, *, slots: int, block_size: int, max_context: int,
                 num_blocks: int | None = None, max_prefill_attempts: int = 3, handoff_timeout_s: float = 30.0):
        if not handoff_timeout_s > 0:
            raise ValueError(f"handoff_timeout_s must be > 0, got {handoff_timeout_s}")
        self.cfg, self.max_context = cfg, max_context
        self.pool = DecodePool(params, cfg, _mesh_devices(mesh_axes), mesh_axes, slots=slots,
                               block_size=block_size, max_context=max_context, num_blocks=num_blocks)
        self.server = start_transfer_server(jax.local_devices())
        self.listener = listen()
        self.inbox: queue.Queue = queue.Queue()
        self.max_prefill_attempts = max_prefill_attempts
        self.handoff_timeout_s = handoff_timeout_s
        self.receiver: KVReceiver | None = None
        self.sched = DecodeScheduler(self.pool, max_prefill_attempts=max_prefill_attempts,
                                     handoff_timeout_s=handoff_timeout_s)

    def serve_forever(self) -> None:
        announce_ready("decode", self.listener, self.server.address())
        sock, _ = self.listener.accept()
        client = Control(sock)
        hello = client.recv()
        if not hello or hello.get("op") != "hello":
            raise ConnectionError(f"expected hello from the client, got {hello!r}")
        prefill = Control.connect(hello["prefill"])
        self.receiver = KVReceiver(prefill.recv()["transfer_address"], self.server)
        threading.Thread(target=self._read_client, args=(client,), daemon=True).start()
        threading.Thread(target=self._read_prefill, args=(prefill,), daemon=True).start()
        self._loop(client, prefill)

    def _read_client(self, client: Control) -> None:
        try:
            while (msg := client.recv()) is not None:
                self.inbox.put(("client", msg))
        except (OSError, ValueError):
            pass
        self.inbox.put(("client", {"op": "shutdown"}))

    def _current(self, msg: dict):
        """The in-flight attempt ``msg`` belongs to, or None (an abandoned attempt's)."""
        a = self.sched.attempts.get(msg["request"])
        return a if a is not None and a.number == msg.get("attempt") else None

    def _read_prefill(self, prefill: Control) -> None:
        """Prefill messages in order; a layer of the current attempt is pulled here (onto the
        owning rank's device) before it is queued, so it reaches the loop before its
        ``ready``. An abandoned attempt's layer is not pulled (its offer expires)."""
        try:
            while (msg := prefill.recv()) is not None:
                msg["t"] = time.monotonic()
                if msg["op"] == "layer" and (a := self._current(msg)) is not None:
                    msg["rows"] = self.receiver.pull(msg, self.pool.target_device(a.res))
                self.inbox.put(("prefill", msg))
            raise ConnectionError("the prefill process closed the control connection")
        except BaseException as e:  # noqa: BLE001 - the loop re-raises it
            self.inbox.put(("crashed", e))

    def _event(self, msg: dict):
        """The scheduler event of a prefill message (None: a layer of an abandoned attempt,
        never pulled)."""
        op, i, n, t = msg["op"], msg["request"], msg.get("attempt"), msg["t"]
        if op == "started":
            return Started(i, n, t)
        if op == "layer":
            return LayerArrived(i, n, msg["layer"], msg["rows"], msg.get("start", 0), msg["nbytes"], t) \
                if "rows" in msg else None
        if op == "ready":
            return Ready(i, n, msg["first_token"], t, info={"prefix_hit_tokens": msg.get("prefix_hit_tokens", 0),
                                                            "prefix_errors": list(msg.get("prefix_errors", []))})
        return Failed(i, n, msg["error"], t, fatal=msg.get("fatal", False))

    def _submit(self, msg: dict):
        """A client's ``generate``: the Submit event, or the RequestError it fails with."""
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
        return Submit(req, time.monotonic(), timeout_s=t,
                      options=(bool(msg.get("prefix_cache", True)), msg.get("retention", "chat")))

    def _loop(self, client: Control, prefill: Control) -> None:
        """The driver of the scheduler in this process: client and prefill messages become
        its events, its actions become messages."""
        sched = self.sched

        def finish(req):
            out = {"op": "done", "request": req.index, "kv_bytes": req.kv_bytes_sent,
                   "prefill_attempts": req.prefill_attempts, "handoff_timeouts": req.handoff_timeouts,
                   "prefix_hit_tokens": req.prefix_hit_tokens, "prefix_errors": list(req.prefix_errors)}
            out.update({"error": str(req.error)} if req.error else {"tokens": req.output})
            client.send(out)

        def carry(actions):
            for a in actions:
                if isinstance(a, StartPrefill):
                    req, (use_store, retention) = a.attempt.request, a.attempt.options
                    prefill.send({"op": "prefill", "request": req.index, "attempt": a.attempt.number,
                                  "prompt": req.prompt, "prefix_cache": use_store, "retention": retention,
                                  "sampling": dataclasses.asdict(req.sampling)})
                elif isinstance(a, CancelPrefill):
                    prefill.send({"op": "cancel", "request": a.request, "attempt": a.attempt})
                elif isinstance(a, Token):
                    client.send({"op": "token", "request": a.request.index, "token": a.token})
                elif isinstance(a, Finished):
                    finish(a.request)

        while True:
            wait = 0.0
            if not sched.running:
                wait = min(1.0, max(0.01, sched.deadline() - time.monotonic()))
            msgs = []
            try:
                msgs.append(self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait())
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for source, msg in msgs:
                if source == "crashed":
                    raise RuntimeError("the prefill link failed") from msg
                op = msg["op"]
                if op == "shutdown":
                    return
                if op == "stats":
                    r = self.receiver
                    client.send({"op": "stats", "kv_bytes_received": r.bytes_received, "pulls": r.pulls,
                                 "pull_seconds": r.pull_seconds, "link_throughput_Bps": r.throughput_Bps,
                                 **sched.stats})
                elif op == "generate":
                    ev = self._submit(msg)
                    if isinstance(ev, Request):            # bad input: fails alone, before any compute
                        finish(ev)
                    else:
                        carry(sched.handle(ev))
                elif op in ("started", "layer", "ready", "failed"):
                    ev = self._event(msg)
                    if ev is None:
                        sched.stats["stale_messages"] += 1
                    else:
                        carry(sched.handle(ev))
            carry(sched.handle(Tick(time.monotonic())))
            if sched.running:
                carry(sched.handle(Stepped(self.pool.step(), time.monotonic())))


# ---- entry point of one role ---------------------------------------------------------------
def _prefix_options(spec: str) -> dict | None:
    """``--prefix-cache``: host blocks (an int; 0 = off) or a JSON object of PrefixStore options."""
    opts = json.loads(spec)
    if type(opts) is int:
        return {"host_blocks": opts} if opts > 0 else None
    if not isinstance(opts, dict):
        raise argparse.ArgumentTypeError(f"a block count or a JSON object, got {spec!r}")
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdjax serve", description="One role of the two-process PD server.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--preset", default="tiny", help="config preset (pdjax.configs)")
    p.add_argument("--seed", type=int, default=0, help="params = init_params(cfg, key(seed))")
    p.add_argument("--mesh", default=None, help='mesh axes as JSON, e.g. \'{"data": 2, "expert": 2}\' '
                                                "(default: expert over all local devices)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged cache, prefix store)")
    p.add_argument("--slots", type=int, default=4, help="decode slots (max running requests)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--prefix-cache", type=_prefix_options, default=None, metavar="SPEC",
                   help="prefill: keep a prefix KV store; SPEC = host blocks (e.g. 256) or a JSON object of "
                        "PrefixStore options, e.g. '{\"device_blocks\": 4, \"host_blocks\": 64}'")
    p.add_argument("--handoff-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="decode: abandon a prefill attempt without progress for this long and re-prefill")
    p.add_argument("--max-prefill-attempts", type=int, default=3,
                   help="decode: prefill attempts (failed or timed out) before a request fails")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    exit_when_orphaned()
    cfg = config_preset(args.preset)
    params = init_params(cfg, jax.random.key(args.seed))
    mesh = json.loads(args.mesh) if args.mesh else {"expert": len(jax.local_devices())}
    if args.role == "prefill":
        PrefillServer(params, cfg, mesh, block_size=args.block_size,
                      prefix_cache=args.prefix_cache).serve_forever()
    else:
        DecodeServer(params, cfg, mesh, slots=args.slots, block_size=args.block_size,
                     max_context=args.max_context or cfg.max_position_embeddings, num_blocks=args.num_blocks,
                     max_prefill_attempts=args.max_prefill_attempts,
                     handoff_timeout_s=args.handoff_timeout).serve_forever()
    return 0
