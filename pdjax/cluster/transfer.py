"""Channels between the processes of pdjax: arrays over ``jax.experimental.transfer``,
control messages over TCP (both bound to loopback unless told otherwise). The PD servers move
latent KV rows over them and the pipeline's rank processes their activations.

Data plane: each process runs a :class:`jax.experimental.transfer.TransferServer` bound to
loopback. The sender (prefill) *offers* an array under a fresh integer uuid
(``TransferServer.await_pull``); the receiver (decode) *pulls* it straight onto one of its
own devices (``TransferConnection.pull`` with a ``ShapeDtypeStruct`` carrying the target
sharding). No host pickling, no copy through the control socket.

Control plane: :class:`Control`, length-prefixed JSON over a TCP socket (4-byte big-endian
length, then UTF-8 JSON). A layer is announced with
``{"op": "layer", "request": i, "layer": l, "uuid": u, "shape": [T, C+R], "dtype": "float32",
"nbytes": T * (C+R) * itemsize, "layout": {...}}`` after it has been offered, so the pull never
waits for it. The receiver refuses a pull whose target sharding lays the array out other than
the announced ``layout`` (jax.experimental.transfer would return wrong data silently) and puts
a deadline of its own on every pull (jax's pull timeout does not fire).

A sender with ``transport="shm"`` (processes of one host) writes the array's bytes to a file
in shared memory instead, under the same descriptor (plus its path); the receiver reads it
onto its devices with the same checks. The pipeline's CPU ranks use it: a transfer pull on
CPU devices takes the sender's core, which a computing rank does not have to spare.

Everything listens on 127.0.0.1 by default (``listen(host)``, ``start_transfer_server(host=)``
for another interface) with port 0 (a random free port the OS picks).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import itertools
import json
import math
import os
import secrets
import socket
import struct
import tempfile
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer as jax_transfer

LOOPBACK = "127.0.0.1"
_HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 1 << 30


# ---- control plane -------------------------------------------------------------------------
class Control:
    """One end of a control connection: ``send(obj)`` (thread-safe) and ``recv()`` (one
    reader), JSON objects framed by a 4-byte length. ``recv`` returns None at end of stream;
    a peer that vanished mid-message raises ``ConnectionError``."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(cls, address: str, timeout: float = 30.0) -> "Control":
        """Connect to ``host:port``, retrying until ``timeout`` seconds (the peer may still
        be binding)."""
        host, port = split_address(address)
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=timeout)
                sock.settimeout(None)
                return cls(sock)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send(self, obj: dict) -> None:
        data = json.dumps(obj, separators=(",", ":"), default=_plain).encode()
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def recv(self, timeout: float | None = None) -> dict | None:
        """The next message (None at end of stream); ``timeout``: seconds to wait for it to
        begin (TimeoutError past them; the connection stays usable)."""
        self.sock.settimeout(timeout)
        try:
            head = self._read(_HEADER.size, eof_ok=True)
        except socket.timeout:
            raise TimeoutError(f"no control message within {timeout:g} s") from None
        finally:
            self.sock.settimeout(None)
        if head is None:
            return None
        (n,) = _HEADER.unpack(head)
        if n > MAX_MESSAGE_BYTES:
            raise ConnectionError(f"control message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
        return json.loads(self._read(n, eof_ok=False))

    def _read(self, n: int, eof_ok: bool) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                if eof_ok and not buf:
                    return None
                raise ConnectionError(f"control peer closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _plain(value):
    """JSON for numpy scalars and arrays (token ids are often numpy integers)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def listen(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host`` (default loopback; "0.0.0.0" for every interface of
    a multi-host deployment); port 0 = a random free port (``sock.getsockname()``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, port))
    sock.listen(16)
    return sock


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host, int(port)


# ---- data plane ----------------------------------------------------------------------------
BULK_TRANSPORTS = 4
"""Bulk-transport sockets of every transfer server pdjax starts, whatever its devices: a
process that pulls from a server with more of them than it has aborts (jaxlib 0.10:
``socket_bulk_transport.cc`` "Check failed: bind(...) Bad file descriptor"; measured 8 -> 4
and 4 -> 1 abort, 4 -> 8, 1 -> 4 and equal counts work)."""


def start_transfer_server(devices=None, host: str = LOOPBACK) -> jax_transfer.TransferServer:
    """A TransferServer for this process's devices on ``host`` (random free ports), with
    :data:`BULK_TRANSPORTS` bulk sockets (one count for every pdjax process)."""
    devices = list(devices if devices is not None else jax.local_devices())
    client = devices[0].client
    return jax_transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"] * BULK_TRANSPORTS)


def single_device(rows: jax.Array) -> jax.Array:
    """``rows`` as an array on one device: a replicated array's first shard (no copy),
    otherwise a gather onto its first device."""
    if len(rows.sharding.device_set) == 1:
        return rows
    if rows.sharding.is_fully_replicated:
        return rows.addressable_shards[0].data
    return jax.device_put(rows, rows.addressable_shards[0].device)


def layout(sharding: jax.sharding.Sharding, shape) -> dict:
    """How an array of ``shape`` lies on ``sharding``'s devices, as
    ``jax.experimental.transfer`` moves it (shard by shard, in the sharding's device order):
    ``devices`` (how many), ``shards`` (each device's [start, stop] per dimension, in that
    order), ``shard_shape``, and ``spec`` (the partition spec, for messages). JSON-able."""
    shape = tuple(int(d) for d in shape)
    index = sharding.addressable_devices_indices_map(shape)
    shards = [[list(sl.indices(n))[:2] for sl, n in zip(ix, shape)] for ix in index.values()]
    spec = getattr(sharding, "spec", None)
    return {"devices": len(index), "shards": shards, "shard_shape": list(sharding.shard_shape(shape)),
            "spec": "replicated" if spec is None else str(spec)}


def _same_layout(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("devices", "shards", "shard_shape"))


def check_layout(sent: dict | None, sharding: jax.sharding.Sharding, shape, uuid: int, dtype="") -> None:
    """Refuse (ValueError naming both) to pull the array announced with layout ``sent`` into
    ``sharding``, when the two lay it out differently: jax.experimental.transfer would move
    the shards anyway and return wrong data silently."""
    if sent is None:
        raise ValueError(f"pull of uuid {uuid}: the descriptor announces no layout; refusing to pull blind")
    want = layout(sharding, shape)
    if not _same_layout(sent, want):
        raise ValueError(f"pull of uuid {uuid} {tuple(shape)} {dtype}: the target sharding ({_layout_text(want)}) "
                         f"differs from the sender's ({_layout_text(sent)}); refusing to pull")


def _layout_text(lay: dict) -> str:
    return f"{lay['devices']} device(s), spec {lay['spec']}, shard shape {tuple(lay['shard_shape'])}"


TRANSPORTS = ("transfer", "shm")
SHM = "shm"                     # the address of a sender whose transport is shared memory


class ArraySender:
    """The sending end (prefill): ``offer(rows)`` makes ``rows`` pullable once under a fresh
    uuid and returns the descriptor to announce over the control plane. An offer not pulled
    within ``ttl_s`` seconds is dropped by the server (a receiver that died).

    ``transport``: "transfer" (``jax.experimental.transfer``, any hosts) or "shm" (processes
    of one host: the offer writes the array's bytes to a file in shared memory, ``/dev/shm``,
    and the receiver reads them onto its devices; no transfer server). On CPU devices serving
    a transfer pull takes the *sender's* core (a pipeline rank's while it computes: measured
    71 ms per 1.4 MB activation at 2 ranks on 2 cores), where a shared-memory offer is a
    copy by the sender and a read by the receiver, each on its own core."""

    def __init__(self, server: jax_transfer.TransferServer | None = None, ttl_s: float = 120.0,
                 transport: str = "transfer"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        if transport == SHM:
            self.server, self.address = None, SHM
            # files, no directory: a pulled offer leaves nothing behind, even in a process that
            # is killed; what was never pulled goes at close() or when this process ends
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self._prefix = os.path.join(root, f"pdjax-arrays-{os.getpid()}-{secrets.token_hex(4)}-")
            weakref.finalize(self, _remove_offers, self._prefix)
        else:
            self.server = server or start_transfer_server()
            self.address = self.server.address()
        self.ttl_s = ttl_s
        # uuids are random per process, so a restarted peer never meets a stale offer's id
        self._ids = itertools.count(secrets.randbits(40) << 20)
        self.bytes_offered = 0
        self.offers = 0

    def offer(self, rows: jax.Array, gather: bool = True) -> dict:
        """Offer one array (``gather``: as one device's copy, :func:`single_device`; False: as
        it lies, every shard). Returns the descriptor ``{"uuid", "shape", "dtype", "nbytes",
        "layout"}``: nbytes = the array's bytes (elements x itemsize, what a one-device pull
        moves), layout = :func:`layout` of the offered array (the receiver checks it)."""
        rows = single_device(rows) if gather else rows
        desc = self.offer_all([rows])
        return {"uuid": desc["uuid"], **desc["arrays"][0]}

    def offer_all(self, arrays) -> dict:
        """Offer ``arrays`` (each as it lies) under one uuid: one pull takes them all. Returns
        ``{"uuid", "arrays": [{"shape", "dtype", "nbytes", "layout"}, ...], "nbytes"}``."""
        arrays = list(arrays)
        uuid = next(self._ids)
        described = [{"shape": list(a.shape), "dtype": str(a.dtype), "nbytes": int(a.size) * a.dtype.itemsize,
                      "layout": layout(a.sharding, a.shape)} for a in arrays]
        if self.transport == SHM:
            for i, (a, d) in enumerate(zip(arrays, described)):
                d["path"] = f"{self._prefix}{uuid}-{i}"
                with open(d["path"] + ".part", "wb") as f:
                    f.write(np.ascontiguousarray(np.asarray(a)).view(np.uint8))   # its bytes, no copy
                os.replace(d["path"] + ".part", d["path"])      # whole, or not there
        else:
            deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.ttl_s)
            self.server.await_pull(uuid, arrays, timeout=deadline)
        nbytes = sum(d["nbytes"] for d in described)
        self.bytes_offered += nbytes
        self.offers += 1
        return {"uuid": uuid, "arrays": described, "nbytes": nbytes}

    def close(self) -> None:
        """Remove what was offered and not pulled (shared memory)."""
        if self.transport == SHM:
            _remove_offers(self._prefix)


def _remove_offers(prefix: str) -> None:
    """Remove the shared-memory files of a sender's offers that were never pulled."""
    for path in glob.glob(glob.escape(prefix) + "*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


class ArrayReceiver:
    """The receiving end (decode): ``pull(desc, target)`` fetches an offered array onto a
    device or a sharding. Every pull has a deadline (``timeout_s``; jax's own pull timeout
    does not fire). Counts the bytes and the seconds spent in pulls (link throughput)."""

    def __init__(self, sender_address: str, server: jax_transfer.TransferServer | None = None,
                 timeout_s: float = 60.0):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if sender_address == SHM:           # a sender of this host, in shared memory
            self.server, self.connection = server, None
        else:
            self.server = server or start_transfer_server()
            self.connection = self.server.connect(sender_address)
        self.timeout_s = timeout_s
        self.bytes_received = 0
        self.pull_seconds = 0.0
        self.pulls = 0

    def pull(self, desc: dict, target, timeout_s: float | None = None) -> jax.Array:
        """The offered array on ``target`` (a device, or a sharding of the announced layout).

        Refused before pulling (ValueError naming both layouts) when ``target`` lays the array
        out other than the sender did (``desc["layout"]``; jax would return wrong data
        silently) or the descriptor has no layout. Past ``timeout_s`` (default the receiver's)
        raises TimeoutError naming the uuid. A link that breaks mid-pull (the sender's process
        died) raises ConnectionError, as a broken control connection does, so a reader treats
        it as the sender lost (jax raises a JaxRuntimeError)."""
        one = {k: desc.get(k) for k in ("shape", "dtype", "nbytes", "layout")}
        if "path" in desc:                    # a shared-memory offer
            one["path"] = desc["path"]
        (rows,) = self.pull_all({"uuid": desc["uuid"], "arrays": [one], "nbytes": desc["nbytes"]}, [target],
                                timeout_s)
        return rows

    def pull_all(self, desc: dict, targets, timeout_s: float | None = None) -> list:
        """The arrays of one :meth:`ArraySender.offer_all`, array i on ``targets[i]`` (a
        device or a sharding), checked as :meth:`pull` checks one (every layout before any
        byte moves)."""
        uuid, described, targets = int(desc["uuid"]), list(desc["arrays"]), list(targets)
        if len(targets) != len(described):
            raise ValueError(f"pull of uuid {uuid}: {len(described)} arrays announced, {len(targets)} targets given")
        specs = []
        for d, target in zip(described, targets):
            shape = tuple(d["shape"])
            sharding = target if isinstance(target, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(target)
            check_layout(d.get("layout"), sharding, shape, uuid, d["dtype"])
            specs.append(jax.ShapeDtypeStruct(shape, jnp.dtype(d["dtype"]), sharding=sharding))
        t0 = time.perf_counter()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            if self.connection is None:
                arrays = [_read_shared(d, spec, uuid) for d, spec in zip(described, specs)]
            else:
                arrays = self.connection.pull(uuid, specs)
            for a in arrays:                      # one deadline for the whole pull
                wait_pulled(a, uuid, timeout_s, deadline)
        except jax.errors.JaxRuntimeError as e:
            raise ConnectionError(f"pull of uuid {uuid} failed: {e}") from e
        self.pull_seconds += time.perf_counter() - t0
        nbytes = sum(int(a.size) * a.dtype.itemsize for a in arrays)
        if nbytes != desc["nbytes"]:
            raise ValueError(f"pulled {nbytes} bytes for uuid {uuid}, announced {desc['nbytes']}")
        self.bytes_received += nbytes
        self.pulls += 1
        return list(arrays)

    @property
    def throughput_Bps(self) -> float:
        return self.bytes_received / self.pull_seconds if self.pull_seconds > 0 else 0.0


def _read_shared(desc: dict, spec, uuid: int) -> jax.Array:
    """An array a shared-memory sender wrote, onto ``spec``'s sharding; the file is removed."""
    path = desc.get("path")
    if path is None:
        raise ValueError(f"pull of uuid {uuid}: a shared-memory pull needs the offer's path; the sender's "
                         "transport is not shm")
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    host = np.frombuffer(data, spec.dtype)
    if host.size != math.prod(spec.shape):
        raise ValueError(f"pull of uuid {uuid}: {host.size} elements in shared memory, {tuple(spec.shape)} announced")
    return jax.device_put(host.reshape(spec.shape), spec.sharding)


def wait_pulled(rows: jax.Array, uuid: int, timeout_s: float, deadline: float | None = None) -> None:
    """Block until the pulled ``rows`` arrived, at most ``timeout_s`` seconds (the pull
    returns an array future at once). A helper thread waits on the array and this one on the
    thread, with the deadline: the caller wakes the moment the array lands (a backoff poll of
    ``is_ready`` woke up to its last pause, 20 ms, late).
    ``deadline``: a ``time.monotonic()`` shared by the arrays of one pull (default now +
    ``timeout_s``). A pull that never lands leaves its (daemon) waiter blocked."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    if rows.is_ready():
        return
    landed = threading.Event()
    failed: list = []

    def wait():
        try:
            rows.block_until_ready()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(e)
        landed.set()
    threading.Thread(target=wait, daemon=True, name=f"pdjax-pull-{uuid}").start()
    if not landed.wait(max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError(f"pull of uuid {uuid} not complete after {timeout_s:g} s "
                           "(the offer never came, or the link stalled)")
    if failed:
        raise failed[0]
