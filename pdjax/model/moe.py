"""DeepSeek-V2/V3 mixture of experts: the gate and exact, dropless, sort-based dispatch.

Einsum legend: N tokens, D hidden, E routed experts, F expert intermediate size,
k experts per token, A = N*k assignments, G tiles, T rows per tile.

Dispatch sorts the A (token, expert) assignments by expert. Three exact back ends compute the
experts over the sorted rows:
  * ``"bucketed"`` (XLA:CPU default): rows into an [E, C, D] buffer, C = ceil(1.25 A/E), one
    batched GEMM against the weights as stored; ``lax.cond`` falls back to 2C, then to tiled,
    when an expert gets more rows;
  * ``"tiled"``: each expert's rows are padded to a multiple of a tile of T rows, every tile
    belongs to one expert, and tiles run as a batched GEMM against their expert's weights.
    Padding is at most T-1 rows per non-empty expert, chosen so the FLOP overhead is
    <= 12.5 % of the ideal;
  * ``"ragged"``: ``jax.lax.ragged_dot`` grouped GEMM (GPU/TPU; XLA:CPU lowers it to a dense
    dot over every expert, so it is not used there by default).
Nothing is ever dropped.

Precision: the router logits and scores are float32 (tokens and router weight upcast), the
experts run in the tokens' dtype (the compute dtype; weights are cast to it) and their outputs
are summed by the routing weights in float32, then cast back.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from pdjax.config import ModelConfig
from pdjax.model.initializers import scaled_normal

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


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU MLP in x.dtype (the weights are cast to it)."""
    w_gate, w_up, w_down = (w.astype(x.dtype) for w in (w_gate, w_up, w_down))
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


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


def _experts_tiled(x_AD, sorted_e, counts, w_gate, w_up, w_down):
    A, D = x_AD.shape
    E = w_gate.shape[0]
    T = tile_rows(A, E)
    G = num_tiles(A, E, T)
    tiles_e = (counts + T - 1) // T
    tile_end = jnp.cumsum(tiles_e)                      # [E] tiles up to and including e
    row_start = (tile_end - tiles_e) * T                # first padded row of expert e
    group_start = jnp.cumsum(counts) - counts           # first sorted row of expert e
    dest = row_start[sorted_e] + jnp.arange(A, dtype=jnp.int32) - group_start[sorted_e]
    x_rows = jnp.zeros((G * T, D), x_AD.dtype).at[dest].set(x_AD, unique_indices=True)
    tile_expert = jnp.minimum(
        jnp.searchsorted(tile_end, jnp.arange(G), side="right"), E - 1)
    x_GTD = x_rows.reshape(G, T, D)
    h_GTF = jax.nn.silu(jnp.einsum("GTD,GDF->GTF", x_GTD, w_gate[tile_expert])) * jnp.einsum(
        "GTD,GDF->GTF", x_GTD, w_up[tile_expert])
    y_GTD = jnp.einsum("GTF,GFD->GTD", h_GTF, w_down[tile_expert])
    return y_GTD.reshape(G * T, D)[dest]


BUCKET_FACTOR = 1.25


def bucket_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per expert of the bucketed path: ceil(1.25 * A / E)."""
    return max(1, -(-int(num_assignments * BUCKET_FACTOR) // num_experts))


def _experts_bucketed(x_AD, sorted_e, counts, w_gate, w_up, w_down):
    """Exact and dropless. When no expert has more than C = ceil(1.25 A/E) rows (then 2C),
    the rows go to an [E, C, D] buffer and run as one batched GEMM against the expert
    weights as stored (each weight read once, no per-tile copies); otherwise the tiled
    path runs. ``lax.cond`` executes one branch."""
    A, D = x_AD.shape
    E = w_gate.shape[0]
    C = bucket_rows(A, E)
    group_start = jnp.cumsum(counts) - counts
    rank = jnp.arange(A, dtype=jnp.int32) - group_start[sorted_e]

    def bucketed(C):
        def run(_):
            dest = sorted_e * C + rank
            x_ECD = jnp.zeros((E * C, D), x_AD.dtype).at[dest].set(x_AD, unique_indices=True).reshape(E, C, D)
            h_ECF = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", x_ECD, w_gate)) * jnp.einsum(
                "ECD,EDF->ECF", x_ECD, w_up)
            return jnp.einsum("ECF,EFD->ECD", h_ECF, w_down).reshape(E * C, D)[dest]
        return run

    def tiled(_):
        return _experts_tiled(x_AD, sorted_e, counts, w_gate, w_up, w_down)

    busiest = counts.max()
    return jax.lax.cond(busiest <= C, bucketed(C), lambda _: jax.lax.cond(
        busiest <= 2 * C, bucketed(2 * C), tiled, None), None)


def _experts_ragged(x_AD, sorted_e, counts, w_gate, w_up, w_down):
    del sorted_e
    h = jax.nn.silu(jax.lax.ragged_dot(x_AD, w_gate, counts)) * jax.lax.ragged_dot(x_AD, w_up, counts)
    return jax.lax.ragged_dot(h, w_down, counts)


def default_impl() -> str:
    return "bucketed" if jax.default_backend() == "cpu" else "ragged"


def routed_experts(p, x_ND, weights_Nk, idx_Nk, impl: str | None = None):
    """sum_j weights[n,j] * Expert_{idx[n,j]}(x[n]) for every token, exactly. [N,D]."""
    impl = impl or default_impl()
    N, D = x_ND.shape
    k = idx_Nk.shape[1]
    E = p["w_gate"].shape[0]
    order, sorted_e, counts = sort_assignments(idx_Nk, E)
    x_AD = x_ND[order // k]
    fn = {"tiled": _experts_tiled, "bucketed": _experts_bucketed, "ragged": _experts_ragged}.get(impl)
    if fn is None:
        raise ValueError(f"unknown MoE impl {impl!r}; use 'bucketed', 'tiled' or 'ragged'")
    w_experts = (p[name].astype(x_ND.dtype) for name in ("w_gate", "w_up", "w_down"))   # compute dtype
    y_sorted = fn(x_AD, sorted_e, counts, *w_experts)
    y_AD = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y_NkD = y_AD.reshape(N, k, D).astype(jnp.float32)
    return jnp.einsum("NkD,Nk->ND", y_NkD, weights_Nk).astype(x_ND.dtype)


def experts_for_rows(p, rows_RD, ids_R, expected_rows: int, impl: str | None = None):
    """Each row through its own expert: ``ids_R`` the expert of each row, -1 for an empty row
    (output 0). For a buffer of R rows of which about ``expected_rows`` are real, e.g. an
    expert-parallel receive buffer sized for the worst case (R = X*C rows, ~n*k real).

    The bucketed back end sizes its [E, C, D] buckets by ``expected_rows``, not R, and leaves
    the empty rows out, so the work follows the real rows (C = ceil(1.25 expected / E), then
    2C, then the tiled path over all R rows when an expert gets more): exact whatever the
    routing. Other back ends run over all R rows, the empty ones weighted 0 and spread."""
    E = p["w_gate"].shape[0]
    impl = impl or default_impl()
    p = {k: p[k].astype(rows_RD.dtype) for k in ("w_gate", "w_up", "w_down")}
    real = ids_R >= 0
    weights, idx = mask_routing(jnp.ones((rows_RD.shape[0], 1), jnp.float32), ids_R[:, None], real, E)

    def everything(_):
        return routed_experts(p, rows_RD, weights, idx, "tiled" if impl == "bucketed" else impl)

    if impl != "bucketed":
        return everything(None)
    key = jnp.where(real, ids_R, E)                        # empty rows sort last, counted nowhere
    order = jnp.argsort(key, stable=True)
    sorted_e = key[order]
    counts = jnp.bincount(key, length=E).astype(jnp.int32)
    x = rows_RD[order]
    rank = jnp.arange(x.shape[0], dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[jnp.minimum(sorted_e, E - 1)]
    C = bucket_rows(expected_rows, E)

    def bucketed(C):
        def run(_):
            dest = jnp.where(sorted_e < E, sorted_e * C + rank, E * C)       # E*C: not computed
            x_ECD = jnp.zeros((E * C, x.shape[1]), x.dtype).at[dest].set(x, mode="drop").reshape(E, C, -1)
            h = jax.nn.silu(jnp.einsum("ECD,EDF->ECF", x_ECD, p["w_gate"])) * jnp.einsum(
                "ECD,EDF->ECF", x_ECD, p["w_up"])
            y_sorted = jnp.take(jnp.einsum("ECF,EFD->ECD", h, p["w_down"]).reshape(E * C, -1), dest, axis=0,
                                mode="fill", fill_value=0)
            return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True).astype(rows_RD.dtype)
        return run

    busiest = counts.max()
    return jax.lax.cond(busiest <= C, bucketed(C), lambda _: jax.lax.cond(
        busiest <= 2 * C, bucketed(2 * C), everything, None), None)


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
