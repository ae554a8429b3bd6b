"""The sorted-rows plan and the gather-based MoE back ends that lay rows into slots.

:class:`SortedRows` sorts R rows by expert once; a back end then lays them into its slots by
gathering (slot -> row for the inputs, row -> slot for the outputs) and runs each slot's
expert: :func:`_bucketed_rows` (base buckets as stored plus overflow buckets; the XLA:CPU
default when the routing fits, :func:`bucket_fits`), :func:`_looped_rows` (a loop over tiles,
its fallback) and :func:`_tiled_rows` (``impl="tiled"``). :mod:`pdjax.model.moe` chooses
between them and re-exports these names.

Einsum legend: as :mod:`pdjax.model.moe` (R rows, E experts, D hidden, F expert width,
G tiles, T rows per tile, C / C2 base / overflow bucket rows, H overflow buckets).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.model.moe_decode import swiglu, swiglu_grouped as _swiglu_grouped
from pdjax.model.topk import top_k


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile: the largest power of two <= A / (8 E) (>= 1), capped at 256, so the
    worst-case padding E*(T-1) stays <= A/8."""
    t = max(1, num_assignments // (8 * num_experts))
    return min(1 << (t.bit_length() - 1), 256)


def num_tiles(num_assignments: int, num_experts: int, tile: int) -> int:
    """Static upper bound on sum_e ceil(count_e / T) over any routing."""
    nonempty = min(num_experts, num_assignments)
    return (num_assignments + nonempty * (tile - 1)) // tile


# ---- the sorted-rows plan the gather-based back ends share ---------------------------------
#
# R rows (the A = N*k assignments, or the rows of an expert-parallel receive buffer), each for
# one expert or for none (expert id E: an empty row). The rows are sorted by expert once; a back
# end then lays them into its slots (buckets or tiles) *by gathering*: slot -> row for the
# inputs, row -> slot for the outputs. Row r reads source row r // k of x (k = 1: the rows
# themselves), so the [A, D] copy of the assignments is never made. XLA:CPU runs a scatter as
# a serial loop, so the only scatter left is of R int32 positions.

class SortedRows:
    """Rows sorted by expert. ``sorted_row`` [R] (the row at each sorted position), ``start``
    [E] (first sorted position of expert e), ``counts`` [E], ``rank`` [R] (each row's place
    among its expert's rows, stable; meaningless for empty rows), ``expert`` [R] (E: empty)."""

    def __init__(self, expert_R, num_experts: int):
        R, E = expert_R.shape[0], num_experts
        expert_R = expert_R.astype(jnp.int32)
        iota = jnp.arange(R, dtype=jnp.int32)
        if (E + 1) * R < 2 ** 31:   # one single-operand sort of packed (expert, row) keys
            packed = jax.lax.sort(expert_R * R + iota)
            sorted_e, sorted_row = packed // R, packed % R
        else:
            sorted_e, sorted_row = jax.lax.sort((expert_R, iota), num_keys=1)
        bounds = jnp.searchsorted(sorted_e, jnp.arange(E + 1, dtype=jnp.int32), side="left",
                                  method="compare_all" if R * (E + 1) <= 2 ** 20 else "scan").astype(jnp.int32)
        self.R, self.E, self.expert, self.sorted_row = R, E, expert_R, sorted_row
        self.start, self.counts = bounds[:E], bounds[1:] - bounds[:E]
        position = jnp.zeros((R,), jnp.int32).at[sorted_row].set(iota, unique_indices=True)
        self.rank = position - self.start[jnp.minimum(expert_R, E - 1)]
        self.real = expert_R < E

    def rows_in(self, expert_S, rank_S, used_S):
        """The row each slot (expert, rank) holds; R where the slot is unused."""
        pos = jnp.minimum(self.start[expert_S] + rank_S, self.R - 1)
        return jnp.where(used_S, self.sorted_row[pos], self.R)


def _gather(x_XD, index_S):
    """x[index], rows past the end reading 0 (an empty slot or row)."""
    return jnp.take(x_XD, index_S, axis=0, mode="fill", fill_value=0)


def _tiles(plan: SortedRows, T: int):
    """Each expert's rows in tiles of T rows, one expert per tile, in expert order, for a static
    G = num_tiles(R, E, T) tiles that fit any routing. Returns (tile_expert [G], tiles in use
    (traced), row_S [G*T]: the row each slot holds, R where unused, slot_R [R]: each row's slot,
    G*T for an empty row)."""
    R, E = plan.R, plan.E
    G = num_tiles(R, E, T)
    tiles_e = (plan.counts + T - 1) // T
    tile_end = jnp.cumsum(tiles_e)
    first_tile = tile_end - tiles_e
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(G), side="right"), E - 1).astype(jnp.int32)
    expert_S = jnp.repeat(tile_expert, T)
    rank_S = (jnp.arange(G * T, dtype=jnp.int32) - first_tile[expert_S] * T)
    row_S = plan.rows_in(expert_S, rank_S, rank_S < plan.counts[expert_S])
    slot_R = jnp.where(plan.real, first_tile[jnp.minimum(plan.expert, E - 1)] * T + plan.rank, G * T)
    return tile_expert, tile_end[-1], row_S, slot_R


def _tiled_rows(x_src, k, plan: SortedRows, w_gate, w_up, w_down):
    """Each expert's rows padded to tiles of T rows (:func:`tile_rows`, :func:`_tiles`), the
    tiles one batched GEMM against their experts' weights (gathered per tile: G copies of an
    expert's matrices). Returns every row's output [R, D] (0: empty)."""
    T, D = tile_rows(plan.R, plan.E), x_src.shape[1]
    tile_expert, _, row_S, slot_R = _tiles(plan, T)
    x_GTD = _gather(x_src, row_S // k).reshape(-1, T, D)
    y_GTD = _swiglu_grouped(x_GTD, w_gate[tile_expert], w_up[tile_expert], w_down[tile_expert])
    return _gather(y_GTD.reshape(-1, D), slot_R)


def loop_tile_rows(C: int) -> int:
    """Rows per tile of the bucketed back end's fallback loop, for base buckets of C rows:
    half a bucket, which bounds the padding by E*(T-1) < 0.57 A for C >= 32 (a skewed 8x256
    prefill of 64 experts top-6 runs as fast at T = 108 as at 216, and slower at 27: each step
    copies its expert's weights), but at least min(C, 16) rows, where a step's fixed cost
    outweighs the padding (a 64-token decode batch: 3.9 ms at T = 9, 6.8 ms at 5)."""
    return max(-(-C // 2), min(C, 16))


def _looped_rows(x_src, k, plan: SortedRows, T: int, w_gate, w_up, w_down):
    """The bucketed back end's fallback, exact for any routing: each expert's rows in tiles of
    T rows (:func:`_tiles`), one tile a step of a loop (``lax.scan`` over the G tiles a routing
    can need, those past the tiles in use skipped by ``lax.cond``, so it differentiates), each
    step one [T, D] GEMM per matrix against its expert's weights, read in place by a dynamic
    index. Unlike :func:`_tiled_rows` no [G, D, F] copies of the weights are made: the program's
    memory is the rows, not G experts' weights (2.5 GB of float32 temporaries, mostly never
    touched, for an 8x256-token prefill of 64 experts top-6 at D=1024, F=256). Returns every
    row's output [R, D] (0: empty)."""
    D = x_src.shape[1]
    tile_expert, in_use, row_S, slot_R = _tiles(plan, T)
    x_GTD = _gather(x_src, row_S // k).reshape(-1, T, D)

    def tile(g, e, x_TD):
        w = (jax.lax.dynamic_index_in_dim(m, e, keepdims=False) for m in (w_gate, w_up, w_down))
        return swiglu(x_TD, *w)

    def step(_, g_e_x):
        return None, jax.lax.cond(g_e_x[0] < in_use, tile, lambda *_: jnp.zeros((T, D), x_src.dtype), *g_e_x)

    _, y_GTD = jax.lax.scan(step, None, (jnp.arange(x_GTD.shape[0], dtype=jnp.int32), tile_expert, x_GTD))
    return _gather(y_GTD.reshape(-1, D), slot_R)


BASE_FACTOR = 1.125       # base bucket rows per expert, x the mean load A/E
OVERFLOW_SHARE = 0.125    # overflow bucket rows, as a share of A, for the E/4 most loaded experts


def bucket_layout(num_rows: int, num_experts: int) -> tuple[int, int, int]:
    """(C, H, C2) of the bucketed back end for about ``num_rows`` real rows: C =
    ceil(1.125 R/E) base rows for every expert and C2 = ceil(R/(8H)) overflow rows for each of
    the H = ceil(E/4) most loaded experts: (E*C + H*C2) <= 1.25 R + E + H slots in all."""
    E, R = num_experts, max(1, num_rows)
    H = -(-E // 4)
    return -(-int(R * BASE_FACTOR * 8) // (8 * E)), H, -(-int(R * OVERFLOW_SHARE * 8) // (8 * H))


def bucket_fits(plan: SortedRows, C: int, H: int, C2: int):
    """True when the routing fits the bucket layout: at most H experts hold more than C rows,
    none more than C + C2."""
    over = jnp.maximum(plan.counts - C, 0)
    return (over > C2).sum() + ((over > 0).sum() > H) == 0


def _bucketed_rows(x_src, k, plan: SortedRows, C, H, C2, w_gate, w_up, w_down):
    """Base buckets [E, C, D] run as one batched GEMM against the weights as stored (each read
    once, never copied); rows of an expert past C go to one of H overflow buckets [H, C2, D],
    which run against the weights of the H most loaded experts (gathered: H of E copied).
    Only valid when :func:`bucket_fits`. Returns every row's output [R, D] (0: empty)."""
    E, D = plan.E, x_src.shape[1]
    over = jnp.maximum(plan.counts - C, 0)
    heavy = top_k(over, H)[1].astype(jnp.int32)                 # [H] most loaded experts

    def inputs(expert_S, rank_S):    # each bucket gathered on its own: slicing one buffer copies
        return _gather(x_src, plan.rows_in(expert_S, rank_S, rank_S < plan.counts[expert_S]) // k)

    x_base = inputs(jnp.repeat(jnp.arange(E, dtype=jnp.int32), C), jnp.tile(jnp.arange(C, dtype=jnp.int32), E))
    x_over = inputs(jnp.repeat(heavy, C2), C + jnp.tile(jnp.arange(C2, dtype=jnp.int32), H))
    y_base = _swiglu_grouped(x_base.reshape(E, C, D), w_gate, w_up, w_down).reshape(E * C, D)
    y_over = _swiglu_grouped(x_over.reshape(H, C2, D), w_gate[heavy], w_up[heavy],
                             w_down[heavy]).reshape(H * C2, D)
    e = jnp.minimum(plan.expert, E - 1)
    bucket = jnp.zeros((E,), jnp.int32).at[heavy].set(jnp.arange(H, dtype=jnp.int32), unique_indices=True)
    slot_R = jnp.where(plan.rank < C, e * C + plan.rank, E * C + bucket[e] * C2 + plan.rank - C)
    slot_R = jnp.where(plan.real, slot_R, E * C + H * C2)
    return _gather(jnp.concatenate([y_base, y_over]), slot_R)
