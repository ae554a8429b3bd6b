"""Test-only fault injection at an AFD pool's seams (as faults.py at the KV link):
:class:`FailingFFN` wraps its FFN side (``pool.ffn``) and fails chosen calls;
:class:`SlowExchange` and :class:`FlippingExchange` wrap its exchange (``pool.exchange``):
slow A2F copies, and a bit flipped on the wire on chosen calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from faults import _slow_identity, flip_bit


class FailingFFN:
    """Wraps an AFD pool's FFN side (``pool.ffn``): the calls numbered in ``fail_calls``
    (0, 1, ... in the order the pool makes them) raise, as an FFN rank that went down."""

    def __init__(self, inner, fail_calls=()):
        self.inner, self.fail_calls, self.calls = inner, set(fail_calls), 0

    def __call__(self, layer, pieces):
        n, self.calls = self.calls, self.calls + 1
        if n in self.fail_calls:
            raise ConnectionError(f"injected: an FFN rank is down (call {n}, layer {layer})")
        return self.inner(layer, pieces)


class SlowExchange:
    """An AFD exchange whose A2F copies take ~0.1 s of device time each, asynchronously (the
    sender is not held up): the hidden states' piece on the FFN mesh's first device is
    ready only after a chain of matmuls there, a single-device op like the copy itself (on
    XLA:CPU, programs over several devices start one at a time, in issue order)."""

    def __init__(self, inner):
        self.inner = inner
        self.attention_mesh, self.ffn_mesh = inner.attention_mesh, inner.ffn_mesh
        self._device = inner.ffn_mesh.devices.flat[0]
        self._m = jax.device_put(jnp.full((320, 320), 0.01, jnp.float32), self._device)

    def parts(self, mesh):
        return self.inner.parts(mesh)

    def to_ffn(self, pieces):
        moved, nbytes = self.inner.to_ffn(pieces)          # sealed: ((hidden, *routing), checksums)
        return tuple(((self._slow(hidden),) + tuple(rest), sums) for (hidden, *rest), sums in moved), nbytes

    def _slow(self, array):
        shards = [_slow_identity(_slow_identity(s.data, self._m), self._m) if s.device == self._device else s.data
                  for s in array.addressable_shards]
        return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)

    def to_attention(self, pieces):
        return self.inner.to_attention(pieces)


def flip_in_rank(array, rank: int, row: int = 0, col: int = 0, bit: int = 30):
    """``array`` (rows split over its mesh's ranks) with bit ``bit`` flipped in row ``row``
    (negative: from the end) of rank ``rank``'s slice, at column ``col`` of every further
    axis."""
    per = array.sharding.shard_shape(array.shape)[0]
    return flip_bit(array, bit, (rank * per + row % per,) + (col,) * (array.ndim - 1))


class FlippingExchange:
    """An AFD exchange that corrupts what it moves on chosen calls: the ``to_ffn`` calls
    numbered in ``a2f`` and the ``to_attention`` calls numbered in ``f2a`` (0, 1, ... in the
    order the pool makes them) arrive with bit ``bit`` flipped in one element (``at``: piece
    array, leaf, rank, row, column; default the first element of the first piece array's first
    leaf, the hidden states or the experts' output, on the first rank; see
    :func:`flip_in_rank`); the piece's seal (its checksums) is left as sent. ``flipped``:
    (direction, call) of every flip. Default bit 30: a float32's top exponent bit (a value
    near 1 becomes ~1e38: the tokens change unless the flip is caught)."""

    def __init__(self, inner, a2f=(), f2a=(), bit: int = 30, at=(0, 0, 0, 0, 0)):
        self.inner, self.bit, self.at = inner, bit, at
        self.attention_mesh, self.ffn_mesh = inner.attention_mesh, inner.ffn_mesh
        self.plan = {"a2f": set(a2f), "f2a": set(f2a)}
        self.calls = {"a2f": 0, "f2a": 0}
        self.flipped: list = []

    def parts(self, mesh):
        return self.inner.parts(mesh)

    def to_ffn(self, pieces):
        return self._maybe_flip("a2f", *self.inner.to_ffn(pieces))

    def to_attention(self, pieces):
        return self._maybe_flip("f2a", *self.inner.to_attention(pieces))

    def _maybe_flip(self, direction: str, moved, nbytes):
        n = self.calls[direction]
        self.calls[direction] += 1
        if n not in self.plan[direction]:
            return moved, nbytes
        self.flipped.append((direction, n))
        piece, leaf, rank, row, col = self.at
        moved = list(moved)
        tree, sums = moved[piece]
        leaves, treedef = jax.tree.flatten(tree)
        leaves[leaf] = flip_in_rank(leaves[leaf], rank, row, col, self.bit)
        moved[piece] = (jax.tree.unflatten(treedef, leaves), sums)
        return tuple(moved), nbytes
