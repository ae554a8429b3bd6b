"""The FFN side of AF disaggregation and the exchange between the two sides.

:class:`FFNPool`: every MoE layer's routed experts split over the FFN devices (one mesh axis,
"expert"), run expert-parallel by :func:`pdjax.parallel.ep.ep_moe` (its all-to-all dispatch
and combine) with the routing the attention side computed; no KV, no scheduler, no state
between calls.

:class:`MeshExchange`: how a micro-batch's rows cross between the attention mesh (M ranks)
and the FFN mesh (N ranks). A micro-batch of R rows is split R/M per attention rank and
R/N per FFN rank. ``jax.device_put`` between shardings with different shard boundaries
falls back to a copy through the host that waits for the data, so the rows travel as
K = lcm(M, N) *pieces* of R/K rows, each piece one asynchronous single-device copy. A side
of S ranks holds its rows as K/S *piece arrays* (:func:`split_local`): piece array i holds,
on rank r, the i-th of r's K/S pieces, so every piece is one shard of one array, and piece p
(in row order) is shard p // (K/S) of piece array p % (K/S). The receiving computation
concatenates a rank's pieces (:func:`join_local`). Nothing waits on the host.

Integrity: every piece crosses *sealed* (:func:`seal`): paired with the checksums
(:func:`pdjax.disagg.link.bit_sums`) of each of its leaves, computed by the sending program
on the rank that holds the piece. The receiving program recomputes them on arrival
(:func:`unseal`) and counts the pieces that differ, on device: the FFN side seals its output
*poisoned* where its input piece arrived corrupt (the sums offset by the mismatch), so one
comparison on the attention side covers both directions, and the micro-batch's count rides
with its carry to the step's one host read (see :mod:`pdjax.disagg.afd_attention`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.disagg.link import bit_sums
from pdjax.parallel.ep import ExpertParallel, ep_moe
from pdjax.parallel.mesh import make_mesh, shard_params

ROUTED = ("w_gate", "w_up", "w_down", "log2phy", "logcnt")   # what the FFN side holds of a MoE layer


def _spec(mesh: Mesh) -> P:
    return P(tuple(mesh.axis_names))


def split_local(tree, parts: int, mesh: Mesh) -> tuple:
    """Arrays [S*a, ...] split over every axis of ``mesh`` -> ``parts`` trees of arrays
    [S*a/parts, ...]: tree i holds, on each rank, the i-th slice of that rank's rows (no
    data moves between ranks)."""
    if parts == 1:
        return (tree,)

    def local(t):
        return tuple(jax.tree.map(lambda a: jnp.split(a, parts)[i], t) for i in range(parts))
    return jax.shard_map(local, mesh=mesh, in_specs=(_spec(mesh),), out_specs=_spec(mesh), check_vma=False)(tree)


def join_local(pieces, mesh: Mesh):
    """The inverse of :func:`split_local`: each rank concatenates its slices, in order."""
    if len(pieces) == 1:
        return pieces[0]

    def local(ps):
        return jax.tree.map(lambda *a: jnp.concatenate(a), *ps)
    return jax.shard_map(local, mesh=mesh, in_specs=(_spec(mesh),), out_specs=_spec(mesh),
                         check_vma=False)(tuple(pieces))


def _sums(tree) -> jax.Array:
    """[1, leaves, 2]: :func:`bit_sums` of each leaf of one rank's slice of a piece."""
    return jnp.stack([bit_sums(a) for a in jax.tree.leaves(tree)])[None]


def seal(pieces, mesh: Mesh, poison=None) -> tuple:
    """Piece arrays (trees of arrays [S*a, ...] on ``mesh``) -> ((tree, sums), ...): ``sums``
    [S, leaves, 2] uint32, row r the checksums of rank r's slice, computed on rank r (no data
    moves). ``poison``: per piece array an int32 [S], nonzero where that slice arrived
    corrupt here; added to its sums, so the next receiver's comparison fails as well."""
    def local(ps, bad):
        return tuple((p, _sums(p) + (0 if b is None else b.astype(jnp.uint32)[:, None, None]))
                     for p, b in zip(ps, bad))
    poison = (None,) * len(pieces) if poison is None else tuple(poison)
    return jax.shard_map(local, mesh=mesh, in_specs=(_spec(mesh), _spec(mesh)), out_specs=_spec(mesh),
                         check_vma=False)(tuple(pieces), poison)


def unseal(sealed, mesh: Mesh) -> tuple:
    """Sealed piece arrays on ``mesh`` -> (the piece arrays, per piece array an int32 [S]: 1
    where rank r's slice no longer matches its sums), compared on each rank, on device,
    before the values are used: a slice that fails is replaced by zeros (what a flipped
    exponent bit made of it, inf or NaN, never reaches the experts or the KV cache)."""
    def local(ps):
        out, bad = [], []
        for p, s in ps:
            b = jnp.any(_sums(p) != s)
            out.append(jax.tree.map(lambda a: jnp.where(b, jnp.zeros_like(a), a), p))
            bad.append(b.astype(jnp.int32)[None])
        return tuple(out), tuple(bad)
    return jax.shard_map(local, mesh=mesh, in_specs=(_spec(mesh),), out_specs=_spec(mesh),
                         check_vma=False)(tuple(sealed))


class MeshExchange:
    """The in-process A2F/F2A link (see the module docstring): ``to_ffn(pieces)`` and
    ``to_attention(pieces)`` start moving a micro-batch's piece arrays (tuples of pytrees)
    to the other side and return (its piece arrays there, bytes per leaf that crossed).
    Tests wrap it (a slow or failing exchange), never hooks in the pool."""

    def __init__(self, attention_mesh: Mesh, ffn_mesh: Mesh):
        self.attention_mesh, self.ffn_mesh = attention_mesh, ffn_mesh
        self.pieces = math.lcm(attention_mesh.devices.size, ffn_mesh.devices.size)

    def parts(self, mesh: Mesh) -> int:
        """Piece arrays a side of ``mesh`` holds a micro-batch in: K / its ranks."""
        return self.pieces // mesh.devices.size

    def to_ffn(self, pieces):
        return self._move(pieces, self.attention_mesh, self.ffn_mesh)

    def to_attention(self, pieces):
        return self._move(pieces, self.ffn_mesh, self.attention_mesh)

    def _move(self, pieces, src: Mesh, dst: Mesh):
        slices, where, treedef = outgoing(pieces, src, dst.devices.size)
        dst_devices = list(dst.devices.flat)
        moved = jax.device_put(slices, [dst_devices[q] for _, _, q in where])
        return incoming(moved, where, treedef, dst), leaf_bytes(moved, where, treedef.num_leaves)


def outgoing(pieces, src: Mesh, dst_ranks: int) -> tuple[list, list, object]:
    """The one-device slices of piece arrays ``pieces`` (trees on ``src``) in send order, with
    where each lands on a side of ``dst_ranks`` ranks: ``(slices, where, treedef)``,
    ``where[n] = (j, leaf, q)``: slice n is leaf ``leaf`` of piece array j on destination rank
    q. Piece p = r * (K/S) + i (rank r's i-th) is rank ``p // (K/D)``'s piece array
    ``p % (K/D)`` there (see the module docstring)."""
    ks = len(pieces)
    kd = ks * src.devices.size // dst_ranks
    flat = [jax.tree.flatten(t) for t in pieces]
    slices, where = [], []
    for i, (leaves, _) in enumerate(flat):
        for leaf, arr in enumerate(leaves):
            on = {s.device: s.data for s in arr.addressable_shards}
            for r, device in enumerate(src.devices.flat):
                q, j = divmod(r * ks + i, kd)
                slices.append(on[device])
                where.append((j, leaf, q))
    return slices, where, flat[0][1]


def incoming(arrays, where, treedef, dst: Mesh) -> tuple:
    """The inverse of :func:`outgoing` on the destination: one-device ``arrays`` (on their
    ranks' devices, as ``where`` says) -> the piece arrays (trees on ``dst``)."""
    kd, n_leaves, ranks = 1 + max(j for j, _, _ in where), treedef.num_leaves, dst.devices.size
    grid = [[[None] * ranks for _ in range(n_leaves)] for _ in range(kd)]
    for (j, leaf, q), a in zip(where, arrays):
        grid[j][leaf][q] = a
    sharding = NamedSharding(dst, _spec(dst))
    return tuple(jax.tree.unflatten(treedef, [
        jax.make_array_from_single_device_arrays((ranks * g[0].shape[0],) + g[0].shape[1:], sharding, g)
        for g in grid[j]]) for j in range(kd))


def leaf_bytes(arrays, where, n_leaves: int) -> list[int]:
    """Bytes that crossed per leaf (the slices' sizes summed by leaf)."""
    out = [0] * n_leaves
    for (_, leaf, _), a in zip(where, arrays):
        out[leaf] += int(a.size) * a.dtype.itemsize
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "ep"))
def _routed(p, cfg, sealed, ep):
    """Unseal the A2F pieces, run the experts, seal the output poisoned where a piece came in
    corrupt (the verdict goes back with the F2A: nothing here waits on the host)."""
    pieces, corrupt = unseal(sealed, ep.mesh)
    u, weights, ids, valid = join_local(pieces, ep.mesh)
    y, _ = ep_moe(p, cfg, u, ep, valid, routing=(weights, ids))
    return seal(split_local(y, len(pieces), ep.mesh), ep.mesh, poison=corrupt)


class FFNPool:
    """The expert side: the routed experts of every MoE layer split over ``devices`` (their
    number must divide the experts). ``pool(layer, pieces)``: one micro-batch of MoE layer
    ``layer``, its sealed piece arrays (:func:`seal`) of (normed hidden [R,D], routing weights
    [R,k], expert ids [R,k], valid [R]) on this pool's mesh -> the sealed piece arrays of the
    routed experts' output [R,D] (dropless, exactly the single-device result up to summation
    order), poisoned where an input piece failed its checksum."""

    def __init__(self, params, cfg: ModelConfig, devices):
        self.cfg = cfg
        self.mesh = make_mesh({"expert": len(devices)}, devices)
        self.ep = ExpertParallel(self.mesh)
        routed = {"layers": [{"moe": {k: v for k, v in lp["moe"].items() if k in ROUTED}} if "moe" in lp else {}
                             for lp in params["layers"]]}
        self.params = shard_params(routed, cfg, self.mesh)["layers"]

    def __call__(self, layer: int, pieces):
        return _routed(self.params[layer]["moe"], self.cfg, tuple(pieces), self.ep)
