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
    exceeds C + C2: each expert's rows in tiles of ~C/2 rows, one tile a step against its
    expert's weights read in place (exact for any routing, no copies of the weights). Up to
    FEW_TOKENS tokens (decode) skip the sort: a loop over the experts in use, each read once,
    or every token through every expert, whichever costs less for the experts in use
    (:mod:`pdjax.model.moe_decode`);
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

from pdjax.model_config import ModelConfig
from pdjax.model.initializers import scaled_normal
from pdjax.model.sharding import declare, values
# COMBINE_SCOPE and swiglu live in moe_decode (the decode paths use them too); importable here
from pdjax.model.moe_decode import COMBINE_SCOPE, few_tokens, swiglu  # noqa: F401
from pdjax.model.moe_decode import combine as _combine
# the sorted-rows plan and the gather-based back ends live in moe_dispatch; importable here
from pdjax.model.moe_dispatch import (SortedRows, _bucketed_rows, _looped_rows, _tiled_rows,  # noqa: F401
                                      bucket_fits, bucket_layout, loop_tile_rows, num_tiles, tile_rows)
from pdjax.model.topk import top_k

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
            group_scores = top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, keep = top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[
            jnp.arange(group_scores.shape[0])[:, None], keep].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(-1, E)
    _, idx = top_k(choice, k)
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


def sort_assignments(idx_Nk, num_experts):
    """Sort (token, slot) assignments by expert.

    Returns order [A] (flat assignment index in sorted order), sorted expert ids [A] and
    counts [E] (tokens per expert)."""
    flat = idx_Nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, flat[order], counts


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


def mlp_weights(key, D, F, dtype, leading=(), leading_axes=()) -> dict:
    """A SwiGLU MLP's weights with their logical axes (:func:`pdjax.model.sharding.declare`);
    ``leading``: stacked dims in front (the routed experts: ``(E,)``, axes ``("experts",)``)."""
    k1, k2, k3 = jax.random.split(key, 3)

    def dense(k, shape, fan_in, axes):
        return declare(scaled_normal(k, leading + shape, fan_in ** -0.5, dtype), leading_axes + axes)

    return {"w_gate": dense(k1, (D, F), D, ("embed", "mlp")), "w_up": dense(k2, (D, F), D, ("embed", "mlp")),
            "w_down": dense(k3, (F, D), F, ("mlp", "embed"))}


def init_mlp(key, D, F, dtype, leading=()):
    """A SwiGLU MLP's params (:func:`mlp_weights` without the axes)."""
    return values(mlp_weights(key, D, F, dtype, tuple(leading), (None,) * len(leading)))


def moe_weights(cfg: ModelConfig, key, dtype) -> dict:
    """One MoE layer's weights with their logical axes: the routed experts stacked on
    "experts"; the router (every device gates its own tokens over all experts), its bias and
    the shared experts whole on the expert dim."""
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    k_router, k_experts, k_shared = jax.random.split(key, 3)
    p = mlp_weights(k_experts, D, F, dtype, (E,), ("experts",))
    p["router"] = declare(scaled_normal(k_router, (D, E), D ** -0.5, dtype), ("embed", None))
    if cfg.topk_method == "noaux_tc":
        p["router_bias"] = declare(jnp.zeros((E,), jnp.float32), (None,))
    if cfg.n_shared_experts:
        p["shared"] = mlp_weights(k_shared, D, F * cfg.n_shared_experts, dtype)
    return p


def init_moe(cfg: ModelConfig, key, dtype):
    """One MoE layer's params (:func:`moe_weights` without the axes)."""
    return values(moe_weights(cfg, key, dtype))
