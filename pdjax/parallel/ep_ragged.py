"""Dropless expert parallelism with ``jax.lax.ragged_all_to_all`` and ``jax.lax.ragged_dot``.

Einsum legend: n local tokens, k experts per token, A = n*k assignments, X ranks on the
expert axis, L physical experts per rank, M = X*A receive-buffer rows, D hidden.

The capacity-padded path (:mod:`pdjax.parallel.ep`) sends X*C rows per device whatever the
routing; this path sends exactly the assignments, with no padding on the wire:

1. *dispatch*: sort the A assignments by physical expert (experts of rank r are the
   contiguous slots r*L .. r*L+L-1, so this also groups them by destination rank); exchange
   the per-(rank, local expert) counts with a small ``all_to_all``; work out where each
   block lands on its receiver; one ``ragged_all_to_all`` moves the rows. A receiver's buffer
   holds its sources' blocks one after another, each block sorted by local expert.
2. *compute*: sort the received rows by local expert and run the experts as three
   ``ragged_dot`` grouped GEMMs (group sizes = rows per local expert); unsort.
3. *combine*: a second ``ragged_all_to_all`` with the roles reversed returns every row to the
   slot it left from; each token sums its k results by routing weight.

Nothing is dropped. The receive buffer is sized for the worst case (every rank sends all its
assignments to one rank: M = X*A rows), as static shapes require.

XLA:CPU does not implement ``ragged-all-to-all`` (``UNIMPLEMENTED ... ThunkEmitter``), so
:class:`~pdjax.parallel.ExpertParallel` selects this path automatically only on GPU/TPU
meshes. :func:`ragged_all_to_all_emulated` is a semantic twin of the collective built from
``all_gather`` (O(X) memory, for validation only): ``dispatch="ragged-emulated"`` runs this
exact path on any backend, which is how the tests check it against the single-device model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.model import moe as moe_lib

RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                               *, axis_name):
    """``jax.lax.ragged_all_to_all``'s documented semantics from ``all_gather`` + gathers.

    Each caller's slice i (``operand[input_offsets[i]:+send_sizes[i]]``) goes to rank
    i // (K / X) and is written there at ``output_offsets[i]``; rows no slice covers keep
    ``output``'s value. ``recv_sizes`` must be the transpose of ``send_sizes`` (as the real
    collective requires); the emulation reads the sizes from the senders."""
    del recv_sizes
    X = jax.lax.axis_size(axis_name)
    K = input_offsets.shape[0]
    if K % X:
        raise ValueError(f"ragged_all_to_all: {K} offsets do not divide over axis {axis_name!r} of size {X}")
    per = K // X
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)                               # [X, N, ...]
    gathered = [jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets)]
    start, size, dst = (jax.lax.dynamic_slice_in_dim(g, me * per, per, axis=1).reshape(-1) for g in gathered)
    src = jnp.repeat(jnp.arange(X), per)                                       # [X*per] sender of each slice
    j = jnp.arange(output.shape[0])[:, None]
    hit = (j >= dst[None]) & (j < (dst + size)[None])                          # [M, X*per]
    q = jnp.argmax(hit, axis=1)
    row = jnp.clip(start[q] + j[:, 0] - dst[q], 0, operand.shape[0] - 1)
    val = ops[src[q], row]
    covered = hit.any(axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(covered, val, output)


def _collective(ep):
    return ragged_all_to_all_emulated if ep.dispatch_impl == "ragged-emulated" else jax.lax.ragged_all_to_all


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def dispatch(cfg: ModelConfig, args, specs, ep, plan, physical_ids):
    """Stage 1. ``args``: (x [N,D], valid [N], routing params, given routing or ()) with their
    shard_map ``specs`` (see :func:`pdjax.parallel.ep.ep_dispatch`). Returns (state,
    dropped = 0); every state array is split over all devices."""
    X, L, A, k, axis = plan.X, plan.E_loc, plan.A, plan.k, ep.expert_axis
    M = X * A
    a2a = _collective(ep)

    def local(x, valid, route, routing):
        D = x.shape[1]
        weights, idx = routing or moe_lib.route(route, cfg, x, valid)
        phys = physical_ids(idx, route, ep).reshape(A)
        order = jnp.argsort(phys, stable=True).astype(jnp.int32)             # by expert, so by rank
        counts = jnp.bincount(phys, length=X * L).astype(jnp.int32).reshape(X, L)
        send_sizes = counts.sum(1)                                             # [X] rows to each rank
        input_offsets = _exclusive_cumsum(send_sizes)
        recv_counts = jax.lax.all_to_all(counts, axis, 0, 0, tiled=True)       # [X, L] per source
        recv_sizes = recv_counts.sum(1)
        recv_offsets = _exclusive_cumsum(recv_sizes)                           # my buffer, per source
        output_offsets = jax.lax.all_to_all(recv_offsets, axis, 0, 0, tiled=True)
        return_offsets = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
        send_x = x[order // k]
        recv_x = a2a(send_x, jnp.zeros((M, D), x.dtype), input_offsets, send_sizes,
                     output_offsets, recv_sizes, axis_name=axis)
        state = (recv_x, recv_counts, recv_offsets, recv_sizes, return_offsets, send_sizes,
                 order, weights)
        return state

    state = jax.shard_map(local, mesh=ep.mesh, in_specs=specs, out_specs=(specs[0],) * 8,
                          check_vma=False)(*args)
    return state, jnp.zeros((), jnp.int32)


def _local_expert_ids(M, recv_counts, recv_offsets, recv_sizes):
    """Local expert of each receive-buffer row (L = empty): blocks from each source in order,
    each sorted by local expert with ``recv_counts[source]`` rows per expert."""
    X, L = recv_counts.shape
    j = jnp.arange(M, dtype=jnp.int32)
    block = jnp.searchsorted(jnp.cumsum(recv_sizes), j, side="right")         # X = past the end
    valid = block < X
    b = jnp.minimum(block, X - 1)
    within = j - recv_offsets[b]
    expert = (jnp.cumsum(recv_counts, axis=1)[b] <= within[:, None]).sum(1)
    return jnp.where(valid, expert, L).astype(jnp.int32)


def compute(p, state, ep, batch):
    """Stage 2: each rank's local experts over the rows it received, as ragged_dot GEMMs."""
    experts = {key: p[key] for key in ("w_gate", "w_up", "w_down")}
    recv_x, recv_counts, recv_offsets, recv_sizes = state[:4]
    X = ep.ep_size

    def local(w, rows, recv_counts, recv_offsets, recv_sizes):
        recv_counts = recv_counts.reshape(X, -1)
        ids = _local_expert_ids(rows.shape[0], recv_counts, recv_offsets, recv_sizes)
        order = jnp.argsort(ids, stable=True)
        group_sizes = recv_counts.sum(0)
        x = rows[order]
        w = {key: v.astype(x.dtype) for key, v in w.items()}        # the compute dtype
        h = jax.nn.silu(jax.lax.ragged_dot(x, w["w_gate"], group_sizes)) * jax.lax.ragged_dot(
            x, w["w_up"], group_sizes)
        y = jax.lax.ragged_dot(h, w["w_down"], group_sizes)
        return jnp.zeros_like(y).at[order].set(y, unique_indices=True)

    return jax.shard_map(local, mesh=ep.mesh,
                         in_specs=({k: P(ep.expert_axis) for k in experts}, batch, batch, batch, batch),
                         out_specs=batch, check_vma=False)(experts, recv_x, recv_counts, recv_offsets, recv_sizes)


def combine(y_rows, state, ep, batch, dtype):
    """Stage 3: the rows go back where they came from; each token sums its k results."""
    _, _, recv_offsets, recv_sizes, return_offsets, send_sizes, order, weights = state
    axis = ep.expert_axis
    a2a = _collective(ep)

    def local(rows, recv_offsets, recv_sizes, return_offsets, send_sizes, order, w):
        n, k = w.shape
        D = rows.shape[1]
        back = a2a(rows, jnp.zeros((n * k, D), rows.dtype), recv_offsets, recv_sizes,
                   return_offsets, send_sizes, axis_name=axis)
        y_assign = jnp.zeros_like(back).at[order].set(back, unique_indices=True).reshape(n, k, D)
        return jnp.einsum("nkD,nk->nD", y_assign.astype(jnp.float32), w).astype(dtype)

    return jax.shard_map(local, mesh=ep.mesh, in_specs=(batch,) * 7, out_specs=batch, check_vma=False)(
        y_rows, recv_offsets, recv_sizes, return_offsets, send_sizes, order, weights)
