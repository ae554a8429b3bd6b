"""The KV link seam: how one layer's latent rows travel from a prefill worker to the decode
rank that owns the request's blocks.

A link is any object with

- ``send(chunk) -> (payload, nbytes)``: start moving ``chunk.rows`` towards decode rank
  ``chunk.rank``. The prefill worker announces ``payload`` to the decode side in a
  :class:`~pdjax.disagg.scheduler.LayerArrived` event; ``nbytes`` is what crosses the link.
  ``send`` may raise (a failed transfer: the attempt fails and the request is prefilled
  again) or block (a stalled transfer: the decode side's deadline expires and it cancels the
  attempt);
- ``receive(payload, device) -> rows``: the decode side's end, the rows on ``device``;
- ``cancel(request, attempt)``: the decode side abandoned the attempt; a send of it still in
  progress may give up (raise :class:`Cancelled`).

Implementations: :class:`DevicePutLink` (one process: ``jax.device_put`` onto the rank's
device, asynchronous, so the copy of layer l overlaps layer l+1's compute) and
:class:`TransferLink` (two processes: ``jax.experimental.transfer``).
Faults (failed, stalled, delayed or corrupted transfers, a dying worker) are injected by
wrapping a link, in the tests (``tests/disagg/faults.py``), never by hooks in the engines.

Integrity: the sender checksums each chunk before it enters the link (:func:`checksum`, on
device, no host sync) and reports all of an attempt's checksums with its ``Ready``; the
decode side checksums what arrived, and a mismatch fails the attempt (a corrupt payload)
before the request is admitted, so it is prefilled again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Cancelled(Exception):
    """The decode side abandoned this attempt: stop computing it, send nothing more."""


@dataclasses.dataclass(frozen=True)
class KVChunk:
    """One layer's latent rows ``[T, C+R]`` for prompt positions ``start..start+T-1`` of an
    attempt, bound for decode rank ``rank``."""
    request: int
    attempt: int
    layer: int
    start: int
    rows: Any
    rank: int


def bit_sums(a) -> jax.Array:
    """Two 32-bit sums of ``a``'s bit patterns, plain and position-weighted (Fletcher style:
    a flipped bit or swapped elements change it); any dtype of at most 32 bits, bool as
    uint8. Traceable: called inside other programs (the AF exchange's seals)."""
    if a.dtype == jnp.bool_:
        bits = a.astype(jnp.uint8)
    else:
        bits = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
    flat = bits.reshape(-1).astype(jnp.uint32)
    weight = jnp.arange(1, flat.size + 1, dtype=jnp.uint32)
    return jnp.stack([flat.sum(dtype=jnp.uint32), (flat * weight).sum(dtype=jnp.uint32)])


@jax.jit
def checksum(rows) -> jax.Array:
    """:func:`bit_sums` of a KV chunk's rows, as its own program. On device: no host sync."""
    return bit_sums(rows)


def checksums_to_host(sums: list) -> list:
    """[(layer, start, device checksum)] -> [[layer, start, a, b]] (one transfer)."""
    if not sums:
        return []
    host = np.asarray(jnp.stack([c for *_, c in sums]))
    return [[int(l), int(s), int(a), int(b)] for (l, s, _), (a, b) in zip(sums, host)]


class DevicePutLink:
    """The in-process link: ``jax.device_put`` of the rows onto the rank's device (the
    payload is the moved array; the copy is asynchronous). ``count_bytes=False`` for a
    colocated engine, whose prefill and decode share devices (nothing crosses a link)."""

    def __init__(self, rank_devices, count_bytes: bool = True):
        self.rank_devices = list(rank_devices)
        self.count_bytes = count_bytes

    def send(self, chunk: KVChunk):
        moved = jax.device_put(chunk.rows, self.rank_devices[chunk.rank])
        return moved, (chunk.rows.size * chunk.rows.dtype.itemsize if self.count_bytes else 0)

    def receive(self, payload, device):
        return payload

    def cancel(self, request: int, attempt: int) -> None:
        pass


class TransferLink:
    """The two-process KV link (:mod:`pdjax.cluster.transfer`): ``send`` offers the rows
    (``sender``: a :class:`~pdjax.cluster.transfer.ArraySender`, prefill side) and returns the transfer descriptor as the
    payload announced over the control plane; ``receive`` pulls it onto a device
    (``receiver``: a :class:`~pdjax.cluster.transfer.ArrayReceiver`, decode side)."""

    def __init__(self, sender=None, receiver=None):
        self.sender, self.receiver = sender, receiver

    def send(self, chunk):
        desc = self.sender.offer(chunk.rows)
        return desc, desc["nbytes"]

    def receive(self, payload: dict, device) -> jax.Array:
        return self.receiver.pull(payload, device)

    def cancel(self, request: int, attempt: int) -> None:
        pass                    # an offer nobody pulls expires (ArraySender ttl_s)
