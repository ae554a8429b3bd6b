"""AF disaggregation across processes: the FFN side as its own process (``pdjax serve --role
ffn``), the attention side (:class:`~pdjax.disagg.afd_engine.AFDEngine` with ``ffn_address=``) in
another.

:class:`FFNServer` holds an :class:`~pdjax.disagg.afd_ffn.FFNPool` on its process's devices
and serves any number of attention engines, each on its own control connection.
:class:`RemoteFFN` is the attention side's end: it is both seams
:class:`~pdjax.disagg.afd_attention.AFDPool` calls (the exchange and the FFN pool), so the pool's
step, its retries and its checksums are the in-process ones.

One MoE layer of one micro-batch: ``to_ffn`` offers the sealed A2F piece slices (one
single-device array per slice, :func:`~pdjax.disagg.afd_ffn.outgoing`) on the attention
process's transfer server under one uuid; the call sends ``moe{layer, id, desc, where}``;
the FFN process pulls every slice onto the FFN rank it belongs to (layouts checked, one
deadline), joins them into its piece arrays (:func:`~pdjax.disagg.afd_ffn.incoming`), runs
the experts, offers its sealed output the same way and answers ``out{id, desc, where}``;
``to_attention`` waits for that answer and pulls. Only descriptors cross the control
connection; the arrays move between the transfer servers, never through Python. A failure on the FFN side answers
``error{id, error}``; a dead FFN process ends the connection: both raise in ``to_attention``
(the pool's :class:`~pdjax.disagg.afd_attention.FFNError`: the micro-batch is run again, then its
requests fail alone).

The messages are :data:`pdjax.disagg.wire.ATTENTION_FFN`. The hello: the FFN process says how many ranks it has and the checksums of the routed experts
it holds (:func:`routed_fingerprint`); the attention side refuses params whose routed
experts differ (another seed or checkpoint: every token would be wrong, silently).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.arguments import check_int, check_positive
from pdjax.cluster.supervisor import Supervisor, announce_ready, device_environ
from pdjax.cluster.messages import Channel
from pdjax.cluster.transfer import LOOPBACK, ArrayReceiver, ArraySender, listen, start_transfer_server
from pdjax.disagg.afd_ffn import ROUTED, FFNPool, incoming, leaf_bytes, outgoing
from pdjax.disagg.link import bit_sums
from pdjax.disagg.prefill_server import ready_info
from pdjax.disagg.wire import ATTENTION_FFN

A2F_TREE = jax.tree.structure(((0, 0, 0, 0), 0))        # sealed (normed x, weights, ids, valid), sums
F2A_TREE = jax.tree.structure((0, 0))                   # sealed routed output, sums


@jax.jit
def _fingerprint(leaves):
    return jnp.stack([bit_sums(a) for a in leaves])


def routed_fingerprint(params) -> list:
    """[[layer, name, sum, weighted sum], ...]: :func:`~pdjax.disagg.link.bit_sums` of every
    routed-expert leaf of ``params`` (full params or an FFN pool's), sorted. Equal on two
    processes iff (up to a checksum collision) they hold the same routed experts."""
    layers = params["layers"] if isinstance(params, dict) else params
    named = sorted((l, k, v) for l, lp in enumerate(layers) for k, v in lp.get("moe", {}).items() if k in ROUTED)
    if not named:
        return []
    sums = np.asarray(_fingerprint([v for *_, v in named]))
    return [[l, k, int(a), int(b)] for (l, k, _), (a, b) in zip(named, sums)]


class RemoteFFN:
    """The attention side's end of an FFN process at ``address`` (``host:port``): connects
    and reads its hello (``ranks``: its FFN ranks); :meth:`bind` to the attention mesh, then
    it is the exchange and FFN-pool seams of :class:`~pdjax.disagg.afd_attention.AFDPool` (see the
    module docstring). ``timeout_s``: the deadline of every answer and pull."""

    def __init__(self, address: str, *, timeout_s: float = 60.0):
        self.address, self.timeout_s = address, timeout_s
        self.ctl = Channel.connect(address, ATTENTION_FFN, "attention")
        try:
            hello = self.ctl.expect("hello", timeout=timeout_s)
        except BaseException:
            self.ctl.close()
            raise
        self.hello, self.ranks = hello, int(hello["ranks"])
        self.attention_mesh = None
        self._ids = itertools.count()

    def bind(self, attention_mesh, params) -> None:
        """Serve the attention ranks of ``attention_mesh``, whose ``params`` must hold the FFN
        process's routed experts (ValueError naming the layers that differ)."""
        try:
            mine = routed_fingerprint(params)
            if self.hello["fingerprint"] != mine:
                differ = sorted({f"layer {a[0]} {a[1]}" for a, b in zip(self.hello["fingerprint"], mine) if a != b})
                raise ValueError(f"the FFN process at {self.address} holds other routed experts than these params "
                                 f"({', '.join(differ) or 'other layers or names'} differ): its preset, seed or "
                                 "checkpoint is not the attention side's")
            self.attention_mesh, self.devices = attention_mesh, list(attention_mesh.devices.flat)
            self.pieces = math.lcm(attention_mesh.devices.size, self.ranks)
            # bound where the FFN process reached us: the interface of the control connection
            self.sender = ArraySender(start_transfer_server(jax.local_devices(), self.ctl.sock.getsockname()[0]))
            self.receiver = ArrayReceiver(self.hello["transfer"], server=self.sender.server, timeout_s=self.timeout_s)
            self.ctl.send({"op": "hello", "transfer": self.sender.address, "ranks": len(self.devices)})
        except BaseException:
            self.ctl.close()
            raise

    def parts(self, mesh) -> int:
        """Piece arrays a side of ``mesh`` holds a micro-batch in: K / its ranks."""
        return self.pieces // mesh.devices.size

    def to_ffn(self, pieces):
        """Offer the sealed A2F piece arrays; returns (the handle the call sends, bytes per leaf)."""
        slices, where, _ = outgoing(pieces, self.attention_mesh, self.ranks)
        desc = self.sender.offer_all(slices)
        return {"desc": desc, "where": where}, leaf_bytes(slices, where, A2F_TREE.num_leaves)

    def __call__(self, layer: int, handle: dict) -> int:
        """Ask the FFN process to run MoE layer ``layer`` on the offered pieces; returns the
        call's id (its answer is awaited by :meth:`to_attention`)."""
        n = next(self._ids)
        self.ctl.send({"op": "moe", "id": n, "layer": int(layer), **handle})
        return n

    def to_attention(self, call: int):
        """Wait for call ``call``'s answer and pull the sealed output onto the attention ranks:
        (its piece arrays on the attention mesh, bytes per leaf)."""
        while True:
            msg = self.ctl.recv(timeout=self.timeout_s)
            if msg is None:
                raise ConnectionError(f"the FFN process at {self.address} closed its control connection")
            if not isinstance(msg.get("id"), int) or msg["id"] > call:
                raise RuntimeError(f"the FFN process answered call {msg.get('id')!r}, call {call} was due")
            if msg["id"] == call:             # an older call's late answer (its wait timed out) is dropped
                break
        if msg["op"] == "error":
            raise RuntimeError(f"the FFN process failed call {call}: {msg['error']}")
        where = [tuple(w) for w in msg["where"]]
        arrays = self.receiver.pull_all(msg["desc"], [self.devices[q] for _, _, q in where])
        return incoming(arrays, where, F2A_TREE, self.attention_mesh), leaf_bytes(arrays, where, F2A_TREE.num_leaves)

    def close(self) -> None:
        self.ctl.close()


class FFNServer:
    """The FFN process: the routed experts of ``params`` over ``devices`` (an
    :class:`~pdjax.disagg.afd_ffn.FFNPool`), a control listener and a transfer server on
    ``host``. Serves every attention connection on its own thread, calls in order."""

    def __init__(self, params, cfg, devices, *, host: str = LOOPBACK, pull_timeout_s: float = 60.0):
        check_positive("pull_timeout_s", pull_timeout_s)
        self.pool = FFNPool(params, cfg, list(devices))
        self.fingerprint = routed_fingerprint(self.pool.params)
        self.sender = ArraySender(start_transfer_server(jax.local_devices(), host))
        self.listener = listen(host)
        self.pull_timeout_s = pull_timeout_s
        self.calls = 0

    def serve_forever(self) -> None:
        announce_ready(ready_info("ffn", self.listener, self.sender.address))
        while True:
            sock, _ = self.listener.accept()
            threading.Thread(target=self._serve, args=(Channel(sock, ATTENTION_FFN, "ffn"),), daemon=True).start()

    def _serve(self, ctl: Channel) -> None:
        try:
            ctl.send({"op": "hello", "transfer": self.sender.address, "ranks": int(self.pool.mesh.devices.size),
                      "fingerprint": self.fingerprint})
            hello = ctl.recv()
            if hello is None:
                return
            receiver = ArrayReceiver(hello["transfer"], server=self.sender.server, timeout_s=self.pull_timeout_s)
            ranks = int(hello["ranks"])
            while (msg := ctl.recv()) is not None:
                ctl.send(self._call(msg, receiver, ranks))      # "moe": the one op after hello
        except OSError:
            pass                                   # the attention side went away
        except ValueError as e:                    # a message off the protocol: this connection ends
            print(f"pdjax ffn: {e}", file=sys.stderr, flush=True)
        finally:
            ctl.close()

    def _call(self, msg: dict, receiver: ArrayReceiver, ranks: int) -> dict:
        """One MoE layer of one micro-batch: pull, run, offer; the answer (or the error)."""
        try:
            devices = list(self.pool.mesh.devices.flat)
            where = [tuple(w) for w in msg["where"]]
            arrays = receiver.pull_all(msg["desc"], [devices[q] for _, _, q in where])
            out = self.pool(msg["layer"], incoming(arrays, where, A2F_TREE, self.pool.mesh))
            slices, back, _ = outgoing(out, self.pool.mesh, ranks)
            self.calls += 1
            return {"op": "out", "id": msg["id"], "desc": self.sender.offer_all(slices), "where": back}
        except Exception as e:  # noqa: BLE001 - the call fails alone; the attention side reruns or fails it
            return {"op": "error", "id": msg.get("id"), "error": f"{type(e).__name__}: {e}"}


def launch_ffn(preset: str = "tiny", seed: int = 0, *, devices: int = 4, host: str = LOOPBACK,
               pull_timeout_s: float = 60.0, env: dict | None = None, startup_timeout: float = 120.0,
               stream=None, serve_command=None) -> "_FFNProcess":
    """Start an FFN process (``pdjax serve --role ffn``) with ``devices`` CPU devices, its
    routed experts those of ``init_params(preset, key(seed))``, on a
    :class:`~pdjax.cluster.supervisor.Supervisor`, and return its handle once it is ready:
    ``address``, its control address (``AFDEngine(..., ffn_address=...)``); ``pid``,
    ``kill()`` (SIGKILL), ``log_tail()``, ``close()`` (also as a context manager). ``env``:
    extra environment; ``stream``: where its output goes, prefixed ``[ffn]``;
    ``serve_command``: the command that starts the role (default ``python -m pdjax serve``)."""
    return _FFNProcess(preset, seed, devices=devices, host=host, pull_timeout_s=pull_timeout_s, env=env,
                       startup_timeout=startup_timeout, stream=stream, serve_command=serve_command)


class _FFNProcess:
    """The handle :func:`launch_ffn` returns."""

    def __init__(self, preset: str = "tiny", seed: int = 0, *, devices: int = 4, host: str = LOOPBACK,
                 pull_timeout_s: float = 60.0, env: dict | None = None, startup_timeout: float = 120.0,
                 stream=None, serve_command=None):
        check_int("devices", devices)
        check_int("seed", seed, 0, 2**32 - 1)
        check_positive("pull_timeout_s", pull_timeout_s)
        check_positive("startup_timeout", startup_timeout)
        serve = list(serve_command or [sys.executable, "-m", "pdjax", "serve"])
        self.procs = Supervisor(stream=stream, tail_lines=200)
        self.procs.start([*serve, "--role", "ffn", "--preset", preset, "--seed", str(seed), "--host", host,
                          "--mesh", json.dumps({"expert": devices}), "--pull-timeout", str(pull_timeout_s)],
                         device_environ(devices, env), name="ffn", prefix="[ffn]", orphan_pipe=True)
        try:
            self.info = self.procs.wait_ready(0, startup_timeout)
        except BaseException:
            self.close()
            raise
        self.address = self.info["control"]

    @property
    def pid(self) -> int:
        return self.procs.pid(0)

    def kill(self) -> None:
        """SIGKILL the process (a test's crash)."""
        self.procs.kill(0, wait=False)

    def log_tail(self, lines: int = 60) -> str:
        return self.procs.tail(0, lines)

    def close(self) -> None:
        self.procs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

