"""The prefill role of two-process PD serving (``pdjax serve --role prefill``).

:class:`PrefillServer` accepts decode connections on a loopback control socket and runs
their ``prefill`` jobs one at a time, in order, with the same
:class:`~pdjax.disagg.worker.PrefillWorker` the in-process engines use: each layer's rows
are offered on a :class:`~pdjax.disagg.link.TransferLink` (``jax.experimental.transfer``)
and announced as soon as the layer is dispatched (the pull overlaps the next layer's
compute); then ``ready`` with the first token and the chunks' checksums. ``cancel`` stops an
attempt the decode side abandoned (dropped if queued, stopped at its next layer if running).
A connection that closes drops its queued jobs (their offers expire).

Its messages are :data:`pdjax.disagg.wire.DECODE_PREFILL`. ``link_wrapper`` (Python API
only, no command-line flag): a callable ``factory(link, server) -> link`` that wraps the
transfer link; :meth:`PrefillServer.add_control_op` adds an op to the protocol with its
handler (the fault tests' own entry point, tests/disagg/serve_faulty.py, installs both to
inject failures, stalls, corruption and death).
"""

from __future__ import annotations

import os
import queue
import sys
import threading

import jax

from pdjax.arguments import check_int
from pdjax.cluster.supervisor import announce_ready
from pdjax.disagg.prefill import PrefillPool
from pdjax.disagg.prefix_store import PrefixStore
from pdjax.disagg.clock import Clock
from pdjax.cluster.messages import Channel
from pdjax.cluster.transfer import LOOPBACK, ArraySender, listen, start_transfer_server
from pdjax.disagg.link import TransferLink
from pdjax.disagg.wire import DECODE_PREFILL, PrefillJob, event_to_wire
from pdjax.disagg.worker import PrefillWorker


def ready_info(role: str, listener, transfer_address: str) -> dict:
    """What a role announces on its ready line: its control and transfer addresses (the
    ports the OS picked) and its pid."""
    host, port = listener.getsockname()[:2]
    return {"role": role, "control": f"{host}:{port}", "transfer": transfer_address, "pid": os.getpid()}


def mesh_devices(mesh_axes: dict) -> list:
    """This process's first prod(mesh) devices (ValueError if a size is not a positive
    integer or it has fewer)."""
    if not isinstance(mesh_axes, dict) or not mesh_axes:
        raise ValueError(f"mesh_axes must be a non-empty dict of axis name -> size, got {mesh_axes!r}")
    n = 1
    for name, v in mesh_axes.items():
        n *= check_int(f"mesh axis {name!r}", v)
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"mesh {mesh_axes} needs {n} devices, this process has {len(devices)}")
    return devices[:n]


class PrefillServer:
    """``prefix_cache``: None or PrefixStore options (default 0 device, 256 host blocks);
    ``host``: the address the control listener and the transfer server bind to. Serves any
    number of decode instances, each on its own control connection."""

    def __init__(self, params, cfg, mesh_axes: dict, *, block_size: int = 16, prefix_cache: dict | None = None,
                 link_wrapper=None, host: str = LOOPBACK):
        check_int("block_size", block_size)
        self.pool = PrefillPool(params, cfg, mesh_devices(mesh_axes), mesh_axes)
        self.store = None
        if prefix_cache is not None:
            self.store = PrefixStore(cfg, block_size, dtype=cfg.kv_cache_dtype, device=self.pool.replicated,
                                     **{"device_blocks": 0, "host_blocks": 256, **prefix_cache})
        self.sender = ArraySender(start_transfer_server(jax.local_devices(), host))
        self.link = TransferLink(sender=self.sender)
        self.protocol = DECODE_PREFILL
        self.control_ops: dict = {}                    # op -> handler(message) -> reply
        if link_wrapper is not None:
            self.link = link_wrapper(self.link, self)
        self.worker = PrefillWorker(self.pool, self.link, Clock(), store=self.store)
        self.listener = listen(host)
        self.jobs: queue.Queue = queue.Queue()

    def serve_forever(self) -> None:
        announce_ready(ready_info("prefill", self.listener, self.sender.address))
        threading.Thread(target=self._accept, daemon=True).start()
        while True:
            ctl, job = self.jobs.get()
            if ctl.closed:
                continue
            try:
                self.worker.run(job, lambda event: ctl.send(event_to_wire(event)))
            except OSError:                   # the decode process went away
                ctl.closed = True

    def _accept(self) -> None:
        while True:
            sock, _ = self.listener.accept()
            ctl = Channel(sock, self.protocol, "prefill")
            try:
                ctl.send({"op": "hello", "transfer_address": self.sender.address})
            except OSError:
                continue
            threading.Thread(target=self._read, args=(ctl,), daemon=True).start()

    def add_control_op(self, op: str, request: type, reply: type, handler) -> None:
        """Serve one more op on connections accepted from now on: ``request`` / ``reply``,
        the TypedDicts of the message and its answer; ``handler(message) -> reply``."""
        self.protocol = self.protocol.with_ops("decode", {op: request}).with_ops("prefill", {op: reply})
        self.control_ops[op] = handler

    def _read(self, ctl: Channel) -> None:
        try:
            while (msg := ctl.recv()) is not None:
                op = msg["op"]
                if op in self.control_ops:
                    ctl.send(self.control_ops[op](msg))
                elif op == "cancel":              # at once: the attempt may be queued or running
                    self.worker.cancel(msg["request"], msg["attempt"])
                elif op == "prefill":
                    self.jobs.put((ctl, PrefillJob.from_wire(msg)))
        except OSError:
            pass
        except ValueError as e:                   # a message off the protocol: this connection ends
            print(f"pdjax prefill: {e}", file=sys.stderr, flush=True)
        ctl.closed = True                      # its queued jobs are dropped; its offers expire
