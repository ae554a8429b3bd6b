"""DeepSeek-V2/V3 mixture of experts: the gate and exact, dropless, sort-based dispatch.

Einsum legend: N tokens, D hidden, E routed experts, F expert intermediate size,
k experts per token, A = N*k assignments, G tiles, T rows per tile.

Dispatch sorts the A (token, expert) assignments by expert (:class:`SortedRows`: one sort of
packed keys) and lays them into slots by gathering (slot -> row for the inputs, row -> slot for
the outputs; XLA:CPU runs scatters as serial loops). Three exact back ends:
  * ``"bucketed"`` (XLA:CPU default): base buckets [E, C, D], C = ceil(1.125 A/E), run as one
    batched GEMM against the weights as stored, plus H = ceil(E/4) overflow buckets of
    C2 = ceil(A/(8H)) rows for the most loaded experts (their weights gathered): <= 1.25 A + E + H
    rows in all. ``lax.cond`` runs a loop instead when more than H experts exceed C or one
    exceeds C + C2: each expert's rows in tiles of ~C/2 rows, one tile a step against its expert's
    weights read in place (exact for any routing, no copies of the weights). Up to FEW_TOKENS tokens (decode) skip the sort: a loop over the experts
    in use, each read once, or every token through every expert, whichever costs less for the
    experts in use (:mod:`pdjax.model.moe_decode`);
  * ``"tiled"``: each expert's rows are padded to a multiple of a tile of T rows, every tile
    belongs to one expert, and tiles run as a batched GEMM against their expert's weights.
    Padding is at most T-1 rows per non-empty expert, chosen so the FLOP overhead is
    <= 12.5 % of the ideal;
  * ``"ragged"``: ``jax.lax.ragged_dot`` grouped GEMM (GPU/TPU; XLA:CPU lowers it to a dense
    dot over every expert, so it is not used there by default).
Nothing is ever dropped, and a token's output only ever adds the experts it chose.

Precision: the router logits and scores are float32 (tokens and router weight upcast), the
experts run in the tokens' dtype (the compute dtype; weights are cast to it), their matmuls
accumulated in float32 and rounded back (:func:`pdjax.model.dots.einsum`: on XLA:CPU
this keeps bf16 weights from being copied to float32 on every call), and their outputs are
summed by the routing weights in float32, then cast back.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pdjax.config import ModelConfig
from pdjax.model.initializers import scaled_normal
# COMBINE_SCOPE and swiglu live in moe_decode (the decode paths use them too); importable here
from pdjax.model.moe_decode import COMBINE_SCOPE, few_tokens, swiglu  # noqa: F401
from pdjax.model.moe_decode import combine as _combine, swiglu_grouped as _swiglu_grouped

_STATS: list[list] = []


@contextlib.contextmanager
def collect_stats():
    """At trace time, collect the per-layer statistics MoE implementations record (e.g. the
    dropped-assignment count of a capacity-limited expert-parallel layer), in layer order."""
    stats: list = []
    _STATS.append(stats)
    try:
        yield stats
    finally:
        _STATS.pop()


def record_stat(value) -> None:
    """Called by a MoE implementation once per layer with an int32 scalar."""
    if _STATS:
        _STATS[-1].append(value)


def stacked_stats(stats):
    return jnp.stack(stats) if stats else jnp.zeros((0,), jnp.int32)


def gate(p, cfg: ModelConfig, x_ND):
    """Route tokens. Returns (weights [N,k] float32, expert ids [N,k] int32).

    Scores are softmax or sigmoid of the router logits (float32). With ``noaux_tc`` the
    correction bias is added for *selection only*; weights come from the unbiased scores.
    Group-limited routing keeps the ``topk_group`` best of ``n_group`` groups, scoring a
    group by its max (V2 ``group_limited_greedy``) or the sum of its top-2 biased scores
    (V3 ``noaux_tc``); experts outside kept groups are excluded (-inf).
    """
    logits = x_ND.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    if cfg.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores
    if cfg.topk_method == "noaux_tc":
        choice = scores + p["router_bias"].astype(jnp.float32)
    k, E, G = cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.n_group
    if cfg.topk_method != "greedy" and G > 1:
        grouped = choice.reshape(-1, G, E // G)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[
            jnp.arange(group_scores.shape[0])[:, None], keep].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(-1, E)
    _, idx = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    normalise = cfg.norm_topk_prob and k > 1
    if normalise:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    if cfg.routed_scaling_always or not normalise:
        weights = weights * cfg.routed_scaling_factor
    return weights, idx.astype(jnp.int32)


def mask_routing(weights_Nk, idx_Nk, valid_N, num_experts: int):
    """Padding tokens (``valid_N`` False) get weight 0 and experts spread round-robin
    ((n*k + j) mod E), so a batch padded with identical dummy tokens never piles them onto
    one expert (which would push the exact back ends onto their slow paths). Valid tokens
    are untouched. ``valid_N`` None: every token is valid."""
    if valid_N is None:
        return weights_Nk, idx_Nk
    N, k = idx_Nk.shape
    spread = jnp.arange(N * k, dtype=jnp.int32).reshape(N, k) % num_experts
    v = valid_N[:, None]
    return jnp.where(v, weights_Nk, 0.0), jnp.where(v, idx_Nk, spread)


def route(p, cfg: ModelConfig, x_ND, valid_N=None):
    """The gate's (weights [N,k] float32, expert ids [N,k] int32), padding tokens masked
    (:func:`mask_routing`): what every MoE implementation routes by."""
    return mask_routing(*gate(p, cfg, x_ND), valid_N, cfg.n_routed_experts)


def shared_experts(p, cfg: ModelConfig, x_ND):
    """The shared experts' output [N,D] (0 when the model has none), in x's dtype."""
    if not cfg.n_shared_experts:
        return jnp.zeros_like(x_ND)
    s = p["shared"]
    return swiglu(x_ND, s["w_gate"], s["w_up"], s["w_down"])


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile: the largest power of two <= A / (8 E) (>= 1), capped at 256, so the
    worst-case padding E*(T-1) stays <= A/8."""
    t = max(1, num_assignments // (8 * num_experts))
    return min(1 << (t.bit_length() - 1), 256)


def num_tiles(num_assignments: int, num_experts: int, tile: int) -> int:
    """Static upper bound on sum_e ceil(count_e / T) over any routing."""
    nonempty = min(num_experts, num_assignments)
    return (num_assignments + nonempty * (tile - 1)) // tile


def sort_assignments(idx_Nk, num_experts):
    """Sort (token, slot) assignments by expert.

    Returns order [A] (flat assignment index in sorted order), sorted expert ids [A] and
    counts [E] (tokens per expert)."""
    flat = idx_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, flat[order], counts


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
    heavy = jax.lax.top_k(over, H)[1].astype(jnp.int32)                 # [H] most loaded experts

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


FEW_TOKENS = 16      # up to this many tokens, the bucketed back end skips the sort and buckets


def _experts_ragged(x_AD, counts, w_gate, w_up, w_down):
    h = jax.nn.silu(jax.lax.ragged_dot(x_AD, w_gate, counts)) * jax.lax.ragged_dot(x_AD, w_up, counts)
    return jax.lax.ragged_dot(h, w_down, counts)


def default_impl() -> str:
    return "bucketed" if jax.default_backend() == "cpu" else "ragged"


IMPLS = ("bucketed", "tiled", "ragged")


def _check_impl(impl: str | None) -> str:
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"unknown MoE impl {impl!r}; use 'bucketed', 'tiled' or 'ragged'")
    return impl


def _expert_weights(p, dtype) -> tuple:
    """(w_gate, w_up, w_down) in the compute dtype."""
    return tuple(p[name].astype(dtype) for name in ("w_gate", "w_up", "w_down"))


def _sorted_rows(x_src, k, plan: SortedRows, expected_rows: int, impl: str, w) -> jax.Array:
    """Every row's output [R, D] through the tiled back end, or the bucketed one (buckets sized
    for ``expected_rows``) when the routing fits its layout, else a loop over tiles of about C/2
    rows (:func:`_looped_rows`, :func:`loop_tile_rows`; ``lax.cond``: one branch runs)."""
    if impl == "tiled":
        return _tiled_rows(x_src, k, plan, *w)
    C, H, C2 = bucket_layout(expected_rows, plan.E)
    return jax.lax.cond(bucket_fits(plan, C, H, C2),
                        lambda: _bucketed_rows(x_src, k, plan, C, H, C2, *w),
                        lambda: _looped_rows(x_src, k, plan, loop_tile_rows(C), *w))


def routed_experts(p, x_ND, weights_Nk, idx_Nk, impl: str | None = None):
    """sum_j weights[n,j] * Expert_{idx[n,j]}(x[n]) for every token, exactly. [N,D].

    ``"bucketed"``: up to FEW_TOKENS tokens (decode) loop over the experts in use or run through
    every expert, whichever costs less (:func:`pdjax.model.moe_decode.few_tokens`); more tokens
    run in buckets (:func:`bucket_layout`) when the routing fits them, else through the loop over
    tiles (:func:`_looped_rows`; ``lax.cond``: one branch executes)."""
    impl = _check_impl(impl)
    N, D = x_ND.shape
    k = idx_Nk.shape[1]
    E = p["w_gate"].shape[0]
    w = _expert_weights(p, x_ND.dtype)
    if impl == "ragged":
        order, _, counts = sort_assignments(idx_Nk, E)
        y_sorted = _experts_ragged(x_ND[order // k], counts, *w)
        y_NkD = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True).reshape(N, k, D)
    elif impl == "bucketed" and N <= FEW_TOKENS:
        return few_tokens(x_ND, weights_Nk, idx_Nk, *w)
    else:
        y_NkD = _sorted_rows(x_ND, k, SortedRows(idx_Nk.reshape(-1), E), N * k, impl, w).reshape(N, k, D)
    return _combine(y_NkD, weights_Nk, x_ND.dtype)


def experts_for_rows(p, rows_RD, ids_R, expected_rows: int, impl: str | None = None):
    """Each row through its own expert: ``ids_R`` the expert of each row, -1 for an empty row
    (output 0). For a buffer of R rows of which about ``expected_rows`` are real, e.g. an
    expert-parallel receive buffer sized for the worst case (R = X*C rows, ~n*k real).

    The bucketed back end sizes its buckets by ``expected_rows``, not R (:func:`bucket_layout`),
    and leaves the empty rows out, so the work follows the real rows; when the routing does not
    fit them, the loop over tiles runs over the real rows (statically sized for all R): exact
    whatever the routing. Other back ends run over all R rows, the empty ones weighted 0."""
    E = p["w_gate"].shape[0]
    impl = _check_impl(impl)
    real = ids_R >= 0
    if impl == "ragged":
        weights, idx = mask_routing(jnp.ones((rows_RD.shape[0], 1), jnp.float32), ids_R[:, None], real, E)
        return routed_experts(p, rows_RD, weights, idx, impl)
    return _sorted_rows(rows_RD, 1, SortedRows(jnp.where(real, ids_R, E), E), expected_rows, impl,
                        _expert_weights(p, rows_RD.dtype))


def moe(p, cfg: ModelConfig, x_ND, impl=None, valid_N=None):
    """Routed experts plus shared experts, for flattened tokens [N,D].

    ``impl``: "bucketed" / "tiled" / "ragged" (single device), or a callable
    ``impl(p, cfg, x_ND, valid_N)`` that computes the whole layer another way (e.g.
    pdjax.parallel's expert parallelism). ``valid_N``: [N] bool, False for padding tokens
    (see :func:`mask_routing`); their outputs are meaningless."""
    if callable(impl):
        return impl(p, cfg, x_ND, valid_N)
    weights, idx = route(p, cfg, x_ND, valid_N)
    y = routed_experts(p, x_ND, weights, idx, impl)
    if cfg.n_shared_experts:
        y = y + shared_experts(p, cfg, x_ND)
    return y


def init_mlp(key, D, F, dtype, leading=()):
    k1, k2, k3 = jax.random.split(key, 3)

    def dense(k, shape, fan_in):
        return scaled_normal(k, leading + shape, fan_in ** -0.5, dtype)

    return {"w_gate": dense(k1, (D, F), D), "w_up": dense(k2, (D, F), D), "w_down": dense(k3, (F, D), F)}


def init_moe(cfg: ModelConfig, key, dtype):
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    k_router, k_experts, k_shared = jax.random.split(key, 3)
    p = init_mlp(k_experts, D, F, dtype, leading=(E,))
    p["router"] = scaled_normal(k_router, (D, E), D ** -0.5, dtype)
    if cfg.topk_method == "noaux_tc":
        p["router_bias"] = jnp.zeros((E,), jnp.float32)
    if cfg.n_shared_experts:
        p["shared"] = init_mlp(k_shared, D, F * cfg.n_shared_experts, dtype)
    return p
