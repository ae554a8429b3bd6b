"""Test-only fault injection at the KV link: :class:`FaultyLink` wraps any link
(:mod:`pdjax.disagg.link`) and fails, stalls, delays, corrupts or kills on chosen chunks;
:class:`SlowLink` slows its copies (afd_faults.py: the same for an AFD pool's FFN side and
exchange, and a bit flipped on the exchange);
:class:`ManualClock` lets a test drive the engines' time by hand. The two-process server
is started with this folder's serve_faulty.py, which installs :func:`wrap` in its prefill
process; :func:`inject_prefill_fault` arms faults there (:meth:`FaultyLink.arm`), and
:func:`corrupt_block` flips a byte of a prefix store's block."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.cluster.children import process_state
from pdjax.disagg.link import Cancelled
from pdjax.disagg.clock import Clock


class ManualClock:
    """``now()`` moves only when a test (or a fault) calls ``advance``."""

    def __init__(self):
        self.t = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


class WorkerKilled(BaseException):
    """The in-process stand-in of a prefill process dying mid-transfer (not an Exception:
    nothing on the way catches it as a failed attempt)."""


@dataclasses.dataclass
class Fault:
    """``kind`` on the chunk of ``layer`` of ``attempt`` (of ``request``, or of any request
    whose prompt has ``tokens`` tokens), ``times`` times. ``seconds``: a delay's length, or
    how far a stall moves a ManualClock (with a real clock a stall lasts until the attempt
    is cancelled, at most ``max_wait_s``)."""
    kind: str                      # "fail" | "stall" | "hang" | "delay" | "corrupt" | "kill" | a MALFORMED kind
    layer: int = 1
    attempt: int = 1
    request: int | None = None
    tokens: int | None = None
    seconds: float = 0.0
    times: int = 1
    max_wait_s: float = 30.0

    def matches(self, chunk) -> bool:
        return (self.times > 0 and chunk.layer == self.layer and chunk.attempt == self.attempt
                and (self.request is None or chunk.request == self.request)
                and (self.tokens is None or chunk.start + chunk.rows.shape[0] == self.tokens))


def flip_bit(rows, bit: int = 0, index: tuple | None = None):
    """``rows`` with bit ``bit`` (default the lowest) of its element ``index`` (default the
    first) flipped (a corrupt byte on the wire); a bool element is negated."""
    index = (0,) * rows.ndim if index is None else tuple(index)
    if rows.dtype == jnp.bool_:
        return jax.device_put(rows.at[index].set(~rows[index]), rows.sharding)
    uint = jnp.dtype(f"uint{8 * rows.dtype.itemsize}")
    bits = jax.lax.bitcast_convert_type(rows, uint)
    bits = bits.at[index].set(bits[index] ^ jnp.asarray(1 << bit, uint))
    return jax.device_put(jax.lax.bitcast_convert_type(bits, rows.dtype), rows.sharding)


MALFORMED = ("extra_row", "wrong_device", "wrong_dtype", "zero_row")   # payloads the decode side must refuse
WRONG_LAYOUT = "wrong_layout"    # a transfer descriptor announcing another layout than the offer's


def wrong_layout(desc: dict) -> dict:
    """A transfer descriptor whose layout says the rows lie split over two devices (the
    decode side's pull onto one device must be refused, never pull wrong data)."""
    rows = desc["shape"][0]
    half = [[[0, rows // 2], [0, desc["shape"][1]]], [[rows // 2, rows], [0, desc["shape"][1]]]]
    return {**desc, "layout": {"devices": 2, "shards": half, "shard_shape": [rows // 2, desc["shape"][1]],
                               "spec": "PartitionSpec('x',)"}}


def malformed(kind: str, payload):
    """``payload`` (the link's moved rows) spoiled as ``kind``: one row more, on another
    device (the last one), in float16, or one zero row more (``zero_row``: zeros add nothing
    to either of :func:`pdjax.disagg.link.bit_sums`' sums, so only the decode side's row check
    can refuse it, not the checksum). Across processes (a link whose payload is a
    transfer descriptor) the rows are spoiled as they are offered: the descriptor announces
    what is pulled, one row more or float16 (there is no "wrong device": the decode side
    pulls onto its own; a layout other than offered is :data:`WRONG_LAYOUT`)."""
    if kind == "extra_row":
        return jnp.concatenate([payload, payload[:1]])
    if kind == "zero_row":          # one row more, all bits zero: the checksum is the sent one's
        return jnp.concatenate([payload, jnp.zeros_like(payload[:1])])
    if kind == "wrong_device":
        return jax.device_put(payload, jax.devices()[-1] if list(payload.devices())[0] != jax.devices()[-1]
                              else jax.devices()[0])
    return payload.astype(jnp.float16)


class FaultyLink:
    """Wraps ``inner``; ``faults``: :class:`Fault` s armed now (more with ``arm``). ``fired``:
    (kind, request, attempt, layer) of every fault that went off; ``sent``: (request,
    attempt, layer, start) of every chunk that went through. ``clock``: a ManualClock that
    stalls and delays advance (None: they take real time); ``on_send(chunk)``: called for
    every chunk before it goes (a recorder). ``stall_ends``: how each stall ended
    ("cancelled", or "waited out" when nothing cancelled it within ``max_wait_s``); a
    "hang" ignores cancels and returns only once ``release`` is set (a send that never
    returns); ``hanging``: hangs in progress."""

    def __init__(self, inner, faults=(), clock=None, server=None, on_send=None):
        self.inner, self.clock, self.server, self.on_send = inner, clock, server, on_send
        self.faults = list(faults)
        self.fired: list = []
        self.sent: list = []
        self.stall_ends: list = []
        self.release = threading.Event()
        self.hanging = 0
        self._cancels: dict = {}
        self._lock = threading.Lock()

    def send(self, chunk):
        with self._lock:
            fault = next((f for f in self.faults if f.matches(chunk)), None)
            if fault is not None:
                fault.times -= 1
                self.fired.append((fault.kind, chunk.request, chunk.attempt, chunk.layer))
        if self.on_send is not None:
            self.on_send(chunk)
        if fault is not None:
            chunk = self._inject(fault, chunk)
        self.sent.append((chunk.request, chunk.attempt, chunk.layer, chunk.start))
        offered = fault is not None and fault.kind in MALFORMED and self._offers
        if offered:
            chunk = dataclasses.replace(chunk, rows=malformed(fault.kind, chunk.rows))
        payload, nbytes = self.inner.send(chunk)
        if fault is not None and fault.kind in MALFORMED and not offered:
            payload = malformed(fault.kind, payload)
        elif fault is not None and fault.kind == WRONG_LAYOUT:
            payload = wrong_layout(payload)
        return payload, nbytes

    @property
    def _offers(self) -> bool:
        """The inner link offers rows for a pull from another process (a TransferLink)."""
        return getattr(self.inner, "sender", None) is not None

    def _inject(self, fault: Fault, chunk):
        key = (chunk.request, chunk.attempt)
        if fault.kind == "fail":
            raise ConnectionError(f"injected: the transfer of layer {chunk.layer} failed")
        if fault.kind == "kill":
            if self.server is not None:               # a real process: die now
                os.kill(os.getpid(), signal.SIGKILL)
            raise WorkerKilled(f"injected: the prefill worker died sending layer {chunk.layer}")
        if fault.kind == "corrupt":
            return dataclasses.replace(chunk, rows=flip_bit(chunk.rows))
        if fault.kind == "delay":
            self.clock.advance(fault.seconds) if self.clock else time.sleep(fault.seconds)
            return chunk
        if fault.kind == "stall":                     # hangs until the decode side gives up on it
            event = self._cancels.setdefault(key, threading.Event())
            if self.clock is not None:
                self.clock.advance(fault.seconds)
            cancelled = event.wait(fault.max_wait_s)
            self.stall_ends.append("cancelled" if cancelled else "waited out")
            if cancelled:
                raise Cancelled()
            return chunk
        if fault.kind == "hang":                      # deaf to cancels: returns only when released
            if self.clock is not None:
                self.clock.advance(fault.seconds)
            self.hanging += 1
            self.release.wait()
            self.hanging -= 1
            raise ConnectionError("injected: a hung transfer was released")
        if fault.kind in MALFORMED or fault.kind == WRONG_LAYOUT:     # spoiled in send
            return chunk
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    def receive(self, payload, device):
        return self.inner.receive(payload, device)

    def cancel(self, request: int, attempt: int) -> None:
        self._cancels.setdefault((request, attempt), threading.Event()).set()
        self.inner.cancel(request, attempt)

    def arm(self, msg: dict) -> dict:
        """A ``fault`` control message: ``{"fault": {Fault fields}}`` arms a link fault;
        ``{"corrupt_prefix": prompt}`` flips a byte of the prompt's first cached block."""
        try:
            if "corrupt_prefix" in msg:
                store = self.server.store
                return {"op": "fault", "ok": True, "tier": corrupt_block(store, store.hashes(msg["corrupt_prefix"])[0])}
            fault = Fault(**msg["fault"])
            if fault.kind == "wrong_device" and self._offers:
                raise ValueError("a wrong_device payload cannot cross processes (the decode side pulls onto "
                                 "its own device): use wrong_layout")
            with self._lock:
                self.faults.append(fault)
            return {"op": "fault", "ok": True}
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
            return {"op": "fault", "ok": False, "error": f"{type(e).__name__}: {e}"}


class FaultRequest(TypedDict, total=False):
    """The ``fault`` control op: arm a link fault, or corrupt a cached prefix."""
    fault: dict
    corrupt_prefix: list


class FaultReply(TypedDict, total=False):
    ok: bool
    tier: str
    error: str


def wrap(link, server) -> FaultyLink:
    """The prefill process's link wrapper (tests/disagg/serve_faulty.py passes it to
    ``pdjax.disagg.serve.main``): a FaultyLink, armed by ``fault`` control messages."""
    faulty = FaultyLink(link, server=server)
    server.add_control_op("fault", FaultRequest, FaultReply, faulty.arm)
    return faulty


def inject_prefill_fault(server, **fault) -> dict:
    """Send ``fault`` to the prefill process of a ``launch_pd`` server (started with
    serve_faulty.py) on a control connection of its own; returns the reply, raises if the
    process refused it."""
    from pdjax.cluster.messages import Channel
    from pdjax.disagg.wire import DECODE_PREFILL

    protocol = DECODE_PREFILL.with_ops("decode", {"fault": FaultRequest}).with_ops("prefill", {"fault": FaultReply})
    ctl = Channel.connect(server.prefill_info["control"], protocol, "decode")
    try:
        ctl.expect("hello")
        ctl.send({"op": "fault", **fault})
        reply = ctl.recv()
    finally:
        ctl.close()
    if not reply or not reply.get("ok"):
        raise RuntimeError(f"the prefill process refused the fault {fault}: {reply!r}")
    return reply


def alive(pid: int) -> bool:
    """Whether ``pid`` is in the process table and not a zombie (read from /proc)."""
    return process_state(pid) not in (None, "Z")


def corrupt_block(store, block_hash: int) -> str:
    """Flip one byte of a prefix store's stored copy of ``block_hash`` in whatever tier holds
    it (a host or device array, or the disk tier's chunk file); returns the tier."""
    with store._lock:
        tier = store._where(block_hash, store.clock())
        if tier is None:
            raise KeyError(f"block {block_hash:032x} is not stored")
        data = store._data[tier][block_hash]
        if tier == "disk":
            with open(store._chunk_file(data), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 0xFF]))
            return tier
        bad = np.array(np.asarray(data))            # a copy: in-flight loads keep theirs
        bad.reshape(-1).view(np.uint8)[0] ^= 0xFF
        store._data[tier][block_hash] = jax.device_put(bad, store.device) if tier == "device" else bad
        return tier


def free_blocks(eng) -> list:
    """Free KV blocks per decode rank of an engine."""
    pool = eng.decode
    return [pool.alloc.available(k) for k in range(pool.ranks)]


def assert_nothing_held(eng, free_before) -> None:
    """No reservation pending, no slot running, every block back."""
    pool = eng.decode
    assert pool.pending == [] and all(r is None for r in pool.slot_req)
    assert free_blocks(eng) == free_before


def run_with_faults(eng, prompts, faults, max_new_tokens=5, **kw):
    """``eng.generate`` on a ManualClock with its link wrapped in a FaultyLink armed with
    ``faults``; returns (outputs, the FaultyLink)."""
    clock = ManualClock()
    link = FaultyLink(eng.link, faults, clock=clock)
    eng.link = link
    try:
        return eng.generate(prompts, max_new_tokens=max_new_tokens, clock=clock, **kw), link
    finally:
        eng.link = link.inner


def run_with_hang(eng, prompts, fault, max_new_tokens=5, watchdog_s: float = 30.0):
    """``eng.generate`` while ``fault`` (a "hang": a send that never returns) holds one send;
    returns (outputs, how many sends still hung when generate returned). A watchdog releases
    the hang after ``watchdog_s``, so an engine that waits for it fails its test instead of
    hanging the suite; the hang is released on the way out."""
    clock = ManualClock()
    link = FaultyLink(eng.link, [fault], clock=clock)
    watchdog = threading.Timer(watchdog_s, link.release.set)
    watchdog.start()
    eng.link = link
    try:
        out = eng.generate(prompts, max_new_tokens=max_new_tokens, clock=clock)
        return out, link.hanging
    finally:
        eng.link = link.inner
        link.release.set()
        watchdog.cancel()


BAD_ARRIVALS = [       # (arrival_times for 2 prompts, what the error says)
    ([0, float("nan")], "arrival_times[1] must be finite, got nan"),
    ([0, float("inf")], "arrival_times[1] must be finite, got inf"),
    ([-0.5, 0], "arrival_times[0] must be >= 0, got -0.5"),
    ([0], "1 times for 2 prompts"), ([0, 0, 0], "3 times for 2 prompts"),
    ([0, "1"], "arrival_times[1] must be a real number, got '1'"),
    ([0, True], "arrival_times[1] must be a real number, got True"),
    ([1.0, 0.5], "non-decreasing, got arrival_times[1]=0.5 after arrival_times[0]=1.0"),
    ("01", "must be a list of one time"),
]


class _GuardClock(Clock):
    """The real clock, until ``stop`` is set: then ``now()`` raises, ending a hung generate."""

    def __init__(self):
        super().__init__()
        self.stop = threading.Event()

    def now(self) -> float:
        if self.stop.is_set():
            raise TimeoutError("stopped by the test's guard")
        return super().now()


def generate_within(eng, seconds: float, prompts, max_new_tokens=5, **kw):
    """``eng.generate`` in a thread; returns what it returned or raises what it raised. Not
    done within ``seconds``: the test fails (instead of hanging the suite) and the run is
    ended through its clock (no thread is left serving)."""
    clock, box = _GuardClock(), {}

    def run():
        try:
            box["out"] = eng.generate(prompts, max_new_tokens=max_new_tokens, clock=clock, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        clock.stop.set()
        t.join(120)
        raise AssertionError(f"generate did not return within {seconds} s (hung)")
    if "error" in box:
        raise box["error"]
    return box["out"]


@jax.jit
def _slow_identity(x, m):
    """``x`` unchanged, ready only after a chain of matmuls on ``m``'s device (``x + 0 * s``
    with s finite is ``x`` exactly)."""
    s = jax.lax.fori_loop(0, 64, lambda i, m: jnp.tanh(m @ m), m)[0, 0]
    return x + jnp.asarray(0, x.dtype) * s.astype(x.dtype)


class SlowLink:
    """A link whose copies take ~0.1 s of device time each, asynchronously
    (the sender is not held up): the wire is slower than the layers' compute."""

    def __init__(self, inner):
        self.inner = inner

    def send(self, chunk):
        payload, nbytes = self.inner.send(chunk)
        m = jax.device_put(jnp.full((320, 320), 0.01, jnp.float32), list(payload.devices())[0])
        return _slow_identity(payload, m), nbytes

    def receive(self, payload, device):
        return self.inner.receive(payload, device)

    def cancel(self, request: int, attempt: int) -> None:
        self.inner.cancel(request, attempt)
