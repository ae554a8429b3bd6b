"""MoE: the gate against an independent NumPy transcription of DeepSeek's reference gate,
and the sort-based dispatch against computing each selected expert token by token."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pdjax
from pdjax.model import moe, moe_decode


def numpy_gate(x, router, bias, cfg):
    """DeepSeek's Gate.forward (inference/model.py and the V2 remote code), in NumPy."""
    logits = x.astype(np.float64) @ router.astype(np.float64)
    if cfg.scoring_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    original = scores
    if bias is not None:
        scores = scores + bias
    N, E = scores.shape
    if cfg.n_group > 1 and cfg.topk_method != "greedy":
        g = scores.reshape(N, cfg.n_group, -1)
        gs = np.sort(g, -1)[..., -2:].sum(-1) if bias is not None else g.max(-1)
        keep = np.argsort(-gs, -1)[:, : cfg.topk_group]
        mask = np.ones((N, cfg.n_group), bool)
        np.put_along_axis(mask, keep, False, -1)
        scores = np.where(mask[:, :, None], -np.inf, g).reshape(N, E)
    idx = np.argsort(-scores, -1)[:, : cfg.num_experts_per_tok]
    w = np.take_along_axis(original, idx, -1)
    norm = cfg.norm_topk_prob and cfg.num_experts_per_tok > 1
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    if cfg.model_type == "deepseek_v3" or not norm:
        w = w * cfg.routed_scaling_factor
    return w, idx


CASES = {
    "v3_noaux_tc": dict(),
    "v2_group_limited": dict(scoring_func="softmax", topk_method="group_limited_greedy",
                             norm_topk_prob=False, routed_scaling_factor=1.5, model_type="deepseek_v2"),
    "v2_norm_no_scale": dict(scoring_func="softmax", topk_method="group_limited_greedy",
                             norm_topk_prob=True, routed_scaling_factor=1.5, model_type="deepseek_v2"),
    "greedy": dict(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                   model_type="deepseek_v2", num_experts_per_tok=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gate_matches_reference(case):
    cfg = pdjax.configs.tiny(**CASES[case])
    rng = np.random.RandomState(0)
    x = rng.randn(64, cfg.hidden_size).astype(np.float32)
    router = (rng.randn(cfg.hidden_size, cfg.n_routed_experts) * 0.3).astype(np.float32)
    bias = rng.uniform(-0.2, 0.2, cfg.n_routed_experts).astype(np.float32) \
        if cfg.topk_method == "noaux_tc" else None
    p = {"router": jnp.asarray(router)}
    if bias is not None:
        p["router_bias"] = jnp.asarray(bias)
    w, idx = moe.gate(p, cfg, jnp.asarray(x))
    w_ref, idx_ref = numpy_gate(x, router, bias, cfg)
    order, order_ref = np.argsort(np.asarray(idx), -1), np.argsort(idx_ref, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(idx_ref, order_ref, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(w_ref, order_ref, -1), rtol=1e-5, atol=1e-6)


def test_bias_selects_but_does_not_weigh():
    cfg = pdjax.configs.tiny(n_group=1, topk_group=1)
    x = jnp.ones((1, cfg.hidden_size))
    p = {"router": jnp.zeros((cfg.hidden_size, cfg.n_routed_experts)),
         "router_bias": jnp.arange(cfg.n_routed_experts, dtype=jnp.float32)}
    w, idx = moe.gate(p, cfg, x)
    assert sorted(np.asarray(idx)[0].tolist()) == [6, 7]   # the bias picks the top ids
    # unbiased scores are all sigmoid(0) = 0.5; normalised then scaled
    np.testing.assert_allclose(w, [[cfg.routed_scaling_factor / 2] * 2], rtol=1e-6)


def loop_reference(p, x, w, idx):
    out = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = x[n] @ p["w_gate"][e]
            h = h / (1 + np.exp(-h)) * (x[n] @ p["w_up"][e])
            out[n] += w[n, j] * (h @ p["w_down"][e])
    return out


def _expert_params(E, D, F, seed=0):
    r = np.random.RandomState(seed)
    return {k: (r.randn(E, *s) / np.sqrt(s[0])).astype(np.float32)
            for k, s in (("w_gate", (D, F)), ("w_up", (D, F)), ("w_down", (F, D)))}


_tiled = jax.jit(lambda p, x, w, idx: moe.routed_experts(p, x, w, idx, impl="tiled"))   # one compile per shape


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 4), skew=st.sampled_from(["uniform", "one", "two"]),
       seed=st.integers(0, 2**16))
def test_tiled_dispatch_exact_for_any_routing(n, k, skew, seed):
    E, D, F = 8, 12, 6
    r = np.random.RandomState(seed)
    p = _expert_params(E, D, F, seed)
    x = r.randn(n, D).astype(np.float32)
    if skew == "uniform":
        idx = np.stack([r.choice(E, k, replace=False) for _ in range(n)])
    elif skew == "one":   # every token's first choice is expert 3 (worst case load)
        idx = np.stack([np.r_[3, r.choice([e for e in range(E) if e != 3], k - 1, replace=False)]
                        for _ in range(n)])
    else:
        idx = np.stack([np.arange(k) for _ in range(n)])
    w = r.rand(n, k).astype(np.float32)
    got = _tiled(jax.tree.map(jnp.asarray, p), jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx, jnp.int32))
    np.testing.assert_allclose(got, loop_reference(p, x, w, idx), atol=1e-5, rtol=1e-5)


_bucketed = jax.jit(lambda p, x, w, idx: moe.routed_experts(p, x, w, idx, impl="bucketed"))


def _routing_with_counts(counts, n, k, r):
    """idx [n, k] whose assignments give each expert exactly counts[e] rows (each count <= n,
    so a token's k experts are distinct), tokens in random order."""
    flat = np.repeat(np.arange(len(counts)), counts)
    idx = flat.reshape(k, n).T                  # expert blocks of <= n rows never span a token twice
    assert (np.sort(idx, 1)[:, 1:] != np.sort(idx, 1)[:, :-1]).all()
    return idx[r.permutation(n)]


# E = 8 experts, n = 40 tokens, k = 2: A = 80, bucket_layout -> C = 12 base rows per expert,
# H = 2 overflow buckets of C2 = 5 rows.
BUCKET_CASES = {
    "even": ([10] * 8, True),                          # base buckets only
    "overflow": ([17, 15, 12, 12, 9, 7, 4, 4], True),  # two experts spill 5 and 3 rows into overflow
    "three_over": ([14, 14, 14, 10, 10, 8, 6, 4], False),   # more experts over C than buckets: tiled
    "too_heavy": ([30, 10, 10, 10, 8, 6, 4, 2], False),     # spill beyond C2: tiled
    "at_the_edge": ([17, 12, 12, 12, 12, 7, 4, 4], True),  # exactly C + C2 rows: the last overflow slot
    "one_past": ([18, 12, 12, 12, 11, 7, 4, 4], False),    # C + C2 + 1 rows: one row past it, tiled
}


@pytest.mark.parametrize("case", sorted(BUCKET_CASES))
def test_bucketed_dispatch_exact_in_every_branch(case):
    """The CPU default back end against a token-by-token loop, with routings built to land in
    each branch: base buckets, base + overflow buckets, and the tiled fallback (twice)."""
    counts, fits = BUCKET_CASES[case]
    E, D, F, n, k = 8, 12, 6, 40, 2
    r = np.random.RandomState(sum(counts[:3]))
    p = _expert_params(E, D, F, 3)
    idx = _routing_with_counts(counts, n, k, r)
    assert moe.bucket_layout(n * k, E) == (12, 2, 5)
    plan = moe.SortedRows(jnp.asarray(idx.reshape(-1), jnp.int32), E)
    assert bool(moe.bucket_fits(plan, 12, 2, 5)) == fits
    x = r.randn(n, D).astype(np.float32)
    w = r.rand(n, k).astype(np.float32)
    got = _bucketed(jax.tree.map(jnp.asarray, p), jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx, jnp.int32))
    np.testing.assert_allclose(got, loop_reference(p, x, w, idx), atol=1e-5, rtol=1e-5)


def test_bucketed_fallback_copies_no_weights_and_differentiates():
    """When the routing does not fit the buckets, the bucketed back end loops over tiles of C
    rows, each step reading its expert's weights in place: its compiled program holds no copies
    of the experts' weights beyond the H overflow buckets' (the tiled path gathers one expert's
    matrices per tile: here 256 tiles of one row, 8x all 32 experts' weights), and gradients flow
    through it as through the tiled path (a skewed routing: the fallback runs)."""
    E, D, F, n, k = 32, 64, 128, 64, 4
    p = jax.tree.map(jnp.asarray, _expert_params(E, D, F, 4))
    x = jnp.asarray(np.random.RandomState(4).randn(n, D).astype(np.float32))
    w = jnp.full((n, k), 0.5, jnp.float32)
    idx = jnp.asarray(np.tile(np.arange(k), (n, 1)), jnp.int32)      # 4 experts take every row
    C, H, C2 = moe.bucket_layout(n * k, E)
    assert not bool(moe.bucket_fits(moe.SortedRows(idx.reshape(-1), E), C, H, C2))
    weights = 3 * E * D * F * 4

    def temp(impl):
        f = jax.jit(lambda p, x, w, i: moe.routed_experts(p, x, w, i, impl=impl))
        return f.lower(p, x, w, idx).compile().memory_analysis().temp_size_in_bytes

    assert temp("tiled") > 4 * weights                 # the measure sees weight copies
    assert temp("bucketed") < weights / 2, (temp("bucketed"), weights)

    def loss(impl):
        return lambda p, x: jnp.sum(moe.routed_experts(p, x, w, idx, impl=impl) ** 2)

    got = jax.jit(jax.grad(loss("bucketed"), argnums=(0, 1)))(p, x)
    want = jax.jit(jax.grad(loss("tiled"), argnums=(0, 1)))(p, x)
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("step_bytes", [0, 1 << 40], ids=["loop", "every"])
@pytest.mark.parametrize("E,n,k", [(8, moe.FEW_TOKENS, 3), (64, 4, 2)])
def test_few_tokens_paths_are_exact(E, n, k, step_bytes, monkeypatch):
    """Up to FEW_TOKENS tokens (decode) the bucketed back end loops over the experts in use or
    runs every token through every expert, by cost (moe_decode.few_tokens); the cost of a loop
    step is set here to force each: 0 loops (for E=8 through the run-time ``lax.cond``, 7 of
    8 experts in use; for E=64 statically), 2^40 runs every expert. Either way an expert a
    token did not choose adds nothing to it, even where its output for that token overflows
    to inf (token 0 through expert X here), and an expert nobody chose adds nothing, even with
    NaN weights."""
    monkeypatch.setattr(moe_decode, "LOOP_STEP_BYTES", step_bytes)
    bucketed = jax.jit(lambda p, x, w, idx: moe.routed_experts(p, x, w, idx, impl="bucketed"))  # traced anew
    D, F = 12, 6
    r = np.random.RandomState(5)
    p = _expert_params(E, D, F, 4)
    idx = np.stack([r.choice(E - 1, k, replace=False) for _ in range(n)])     # expert E-1 unused
    X = next(e for e in idx[1:].reshape(-1) if e not in idx[0])               # in use, not by token 0
    x = r.randn(n, D).astype(np.float32)
    x[0], x[1:, 0] = 0, 0
    x[0, 0] = 1e20                     # only expert X reads input dim 0: inf for token 0 there
    for name in ("w_gate", "w_up"):
        p[name][:, 0] = 0
        p[name][X, 0] = 1
    p_nan = {name: w.copy() for name, w in p.items()}
    for w in p_nan.values():
        w[E - 1] = np.nan
    w = r.rand(n, k).astype(np.float32)
    got = bucketed(jax.tree.map(jnp.asarray, p_nan), jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx, jnp.int32))
    np.testing.assert_allclose(got, loop_reference(p, x, w, idx), atol=1e-5, rtol=1e-5)


def test_few_tokens_choice_follows_the_bytes():
    """The decode path by cost: the benchmark's wide layer (64 experts of 1024x256, float32)
    with 38 in use loops (38 x (3 + 1) MiB < 64 x 3 MiB), its small one (16 of 512x256) with
    10 in use runs every expert (10 x 2.5 MiB > 16 x 1.5 MiB); bfloat16 always loops."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert moe_decode.loop_is_cheaper(38, 64, 3 * 1024 * 256 * 4, f32)
    assert not moe_decode.loop_is_cheaper(10, 16, 3 * 512 * 256 * 4, f32)
    assert moe_decode.loop_is_cheaper(16, 16, 3 * 512 * 256 * 2, bf16) is True


def test_bucket_layout_bound():
    """Slots of the bucketed layout: E*C + H*C2 <= 1.25 R + E + H (the FLOP bound model_cost.py
    reports), for any size; and a routing as even as possible always fits."""
    for R in (1, 7, 16, 80, 100, 4096, 12288, 100000):
        for E in (1, 8, 16, 64, 256):
            C, H, C2 = moe.bucket_layout(R, E)
            assert E * C + H * C2 <= 1.25 * R + E + H
            assert C >= -(-R // E) and H * 4 >= E


def test_ragged_dot_path_equals_tiled():
    E, D, F, n, k = 8, 16, 8, 50, 2
    r = np.random.RandomState(1)
    p = jax.tree.map(jnp.asarray, _expert_params(E, D, F))
    x = jnp.asarray(r.randn(n, D).astype(np.float32))
    idx = jnp.asarray(np.stack([r.choice(E, k, replace=False) for _ in range(n)]), jnp.int32)
    w = jnp.asarray(r.rand(n, k).astype(np.float32))
    np.testing.assert_allclose(moe.routed_experts(p, x, w, idx, impl="ragged"),
                               moe.routed_experts(p, x, w, idx, impl="tiled"), atol=1e-5)


def test_tile_padding_bound():
    for A in (1, 7, 16, 100, 4096, 100000):
        for E in (1, 8, 64, 256):
            T = moe.tile_rows(A, E)
            G = moe.num_tiles(A, E, T)
            assert G * T <= A + min(A, E) * (T - 1)
            assert G * T <= 1.125 * A or T == 1


def test_padding_tokens_are_spread_and_weightless(tiny_cfg, tiny_params):
    """A batch of 6 real tokens padded with 26 identical dummy tokens: with the mask, the
    dummies get weight 0 and experts (n*k + j) mod E, so no expert holds more than the real
    load plus ceil(26*k/E); the real tokens' outputs are unchanged, exactly."""
    cfg, p = tiny_cfg, tiny_params["layers"][1]["moe"]
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    real = jax.random.normal(jax.random.key(3), (6, cfg.hidden_size))
    x = jnp.concatenate([real, jnp.zeros((26, cfg.hidden_size))])
    valid = jnp.arange(32) < 6
    w, idx = moe.mask_routing(*moe.gate(p, cfg, x), valid, E)
    w0, idx0 = moe.gate(p, cfg, x)
    np.testing.assert_array_equal(idx[:6], idx0[:6])
    np.testing.assert_array_equal(w[:6], w0[:6])
    assert (np.asarray(w[6:]) == 0).all()
    assert np.asarray(idx[6:]).reshape(-1).tolist() == [(n * k + j) % E for n in range(6, 32) for j in range(k)]
    unmasked = np.bincount(np.asarray(idx0).reshape(-1), minlength=E).max()
    masked = np.bincount(np.asarray(idx).reshape(-1), minlength=E)
    real_load = np.bincount(np.asarray(idx0[:6]).reshape(-1), minlength=E)
    assert (masked <= real_load + -(-26 * k // E)).all() and masked.max() < unmasked
    run = jax.jit(moe.moe, static_argnames=("cfg", "impl"))
    for impl in ("bucketed", "tiled"):
        got = run(p, cfg, x, impl, valid)
        np.testing.assert_allclose(got[:6], run(p, cfg, real, impl), atol=1e-6, rtol=0)


@pytest.mark.parametrize("skew", ["uniform", "two", "one", "all"])
def test_experts_for_rows_ignores_empty_rows_and_is_exact(skew):
    """A receive buffer of 64 rows, 20 real: outputs equal each row through its expert, empty
    rows give 0, whichever cond branch the routing picks (buckets for 20 rows over 8 experts:
    C = 3 base rows each, 2 overflow buckets of 2; 'two' puts 5 rows on experts 3 and 5 (overflow
    buckets), 'one' 7 on expert 3 and 'all' all 20 on one (tiled))."""
    E, D, F, R = 8, 12, 6, 64
    r = np.random.RandomState(2)
    p = jax.tree.map(jnp.asarray, _expert_params(E, D, F))
    rows = r.randn(R, D).astype(np.float32)
    ids = np.full(R, -1, np.int32)
    real = r.choice(R, 20, replace=False)
    ids[real] = {"uniform": np.arange(20) % E, "one": np.r_[[3] * 5, np.arange(15) % E],
                 "two": np.r_[[3] * 5, [5] * 5, [0, 1, 2, 4, 6, 7] * 2][:20],
                 "all": np.full(20, 5)}[skew]
    C, H, C2 = moe.bucket_layout(20, E)
    assert bool(moe.bucket_fits(moe.SortedRows(jnp.asarray(np.where(ids >= 0, ids, E)), E), C, H, C2)) == (
        skew in ("uniform", "two"))
    got = np.asarray(moe.experts_for_rows(p, jnp.asarray(rows), jnp.asarray(ids), 20, "bucketed"))
    want = np.zeros_like(got)
    want[real] = loop_reference(p, rows[real], np.ones((20, 1), np.float32), ids[real][:, None])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_loop_tile_rows_is_an_int_half_bucket():
    """Mutation-testing gap (docs/mutation.md): half a bucket rounded up, an int (a tile
    size), at least min(C, 16)."""
    from pdjax.model.moe_dispatch import loop_tile_rows
    got = [loop_tile_rows(C) for C in (1, 8, 20, 32, 33, 64, 101)]
    assert got == [1, 8, 16, 16, 17, 32, 51] and all(type(t) is int for t in got)


def test_sorted_rows_past_the_packed_key_range():
    """Mutation-testing gap (docs/mutation.md): (E+1)*R >= 2**31 would overflow the packed
    int32 (expert, row) key, so the plan sorts the pair; it must still be a stable sort."""
    from pdjax.model.moe_dispatch import SortedRows
    E, R = 2 ** 20, 2 ** 11                                   # (E+1)*R just past 2**31
    rng = np.random.default_rng(0)
    expert = rng.choice(np.array([0, 5, E - 1, E]), size=R)   # E: an empty row
    plan = SortedRows(jnp.asarray(expert, jnp.int32), E)
    want = np.argsort(expert, kind="stable")
    np.testing.assert_array_equal(np.asarray(plan.sorted_row), want)
    counts = np.asarray(plan.counts)
    assert [counts[e] for e in (0, 5, E - 1)] == [int((expert == e).sum()) for e in (0, 5, E - 1)]
    assert counts.sum() == int((expert < E).sum())
