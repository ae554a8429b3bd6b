"""Scan over layers (pdjax.model.layer_scan): stacked params give the per-layer path's logits,
caches, tokens and MoE stats; the decode step updates the stacked cache in place; bad
combinations fail before any compute."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from hlo_text import stored_arrays
from pdjax.model import layer_scan, moe as moe_lib, transformer
from pdjax.model.layer_scan import LayerRun, layer_runs, stack_layers, unstack_layers

TOL = 1e-5


MAX_LEN = 14   # the prefill/decode and generate tests' cache: test_model.py's shapes (its programs)


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    """Dense and MoE layers (1 dense, then 2 MoE: the MoE run scans two layers)."""
    return tiny_cfg


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params


@pytest.fixture(scope="module")
def stacked(params, cfg):
    return jax.jit(stack_layers, static_argnums=1)(params, cfg)


def _tokens(cfg, shape, seed=0):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, shape).astype(np.int32)


def _router_stat(p, cfg, x_ND, valid_N):
    """A MoE impl that records a per-layer number (from the layer's own router) as its stat."""
    moe_lib.record_stat(_stat_of(p["router"]))
    return moe_lib.moe(p, cfg, x_ND, None, valid_N)


def _stat_of(router):
    return jnp.round(router[0, 0] * 1e4).astype(jnp.int32)


def test_layer_runs():
    v3 = pdjax.configs.deepseek_v3()
    assert layer_runs(v3) == (LayerRun(0, 3, False), LayerRun(3, 61, True))
    alternating = pdjax.configs.tiny(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2)
    assert layer_runs(alternating) == (LayerRun(0, 2, False), LayerRun(2, 3, True), LayerRun(3, 4, False),
                                       LayerRun(4, 5, True))
    dense = pdjax.configs.tiny(n_routed_experts=0, num_hidden_layers=4)
    assert layer_runs(dense) == (LayerRun(0, 4, False),)


def test_stack_unstack_round_trip(params, stacked, cfg):
    assert [jax.tree.leaves(s)[0].shape[0] for s in stacked["layer_runs"]] == [1, 2]
    back = unstack_layers(stacked, cfg)
    chex.assert_trees_all_equal(back, params, strict=True)


def test_forward_and_stats_equal_per_layer(params, stacked, cfg):
    toks = _tokens(cfg, (3, MAX_LEN))
    ref = pdjax.forward(params, cfg, toks)
    out, stats = pdjax.forward(stacked, cfg, toks, moe_impl=_router_stat, return_stats=True)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    want = [int(_stat_of(lp["moe"]["router"])) for lp in params["layers"] if "moe" in lp]
    assert len(set(want)) == len(want) == 2            # one distinct value per MoE layer, in order
    assert np.asarray(stats["dropped_per_moe_layer"]).tolist() == want


def test_prefill_chunk_and_decode_equal_per_layer(params, stacked, cfg):
    toks = _tokens(cfg, (3, MAX_LEN), seed=1)
    lengths = np.array([5, 3, 4], np.int32)
    ref, cache = pdjax.prefill(params, cfg, toks[:, :5], max_len=MAX_LEN, lengths=lengths)
    out, s_cache = pdjax.prefill(stacked, cfg, toks[:, :5], max_len=MAX_LEN, lengths=lengths)
    assert isinstance(s_cache, layer_scan.StackedKVCache)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    ref, cache = pdjax.prefill(params, cfg, toks[:, 5:8], cache=cache)            # chunked prefill
    out, s_cache = pdjax.prefill(stacked, cfg, toks[:, 5:8], cache=s_cache)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    for t in range(8, 12):
        ref, cache = pdjax.decode_step(params, cfg, toks[:, t], cache)
        out, s_cache = pdjax.decode_step(stacked, cfg, toks[:, t], s_cache)
        np.testing.assert_allclose(out, ref, atol=TOL, rtol=0, err_msg=f"step {t}")
    np.testing.assert_array_equal(s_cache.lengths, cache.lengths)
    np.testing.assert_allclose(s_cache.stacked(), cache.stacked(), atol=TOL, rtol=0)
    unstacked = s_cache.unstacked()
    assert len(unstacked.kv) == cfg.num_hidden_layers
    np.testing.assert_array_equal(layer_scan.stack_cache(unstacked, cfg).stacked(), s_cache.stacked())


def test_generate_equals_per_layer(params, stacked, cfg):
    prompts = [list(_tokens(cfg, (n,), seed=n)) for n in (5, 3, 4)]   # the prefill test's shapes
    ref = pdjax.generate(params, cfg, prompts, max_new_tokens=5, max_len=MAX_LEN)
    assert pdjax.generate(stacked, cfg, prompts, max_new_tokens=5, max_len=MAX_LEN) == ref


def test_decode_step_updates_the_stacked_cache_in_place(params, stacked, cfg):
    """The step's output cache aliases its donated input, and its temporaries exceed the
    per-layer step's by at most what one scan iteration slices out (XLA:CPU copies a dynamic
    slice that feeds a dot): one layer's cache rows and one layer's weights. A copy of the
    cache would add all of its bytes."""
    B, S = 4, 1024                # a cache larger than a layer's weights
    tok = jnp.zeros((B,), jnp.int32)

    def memory(p, cache):
        return transformer._decode_step.lower(p, cfg, tok, cache, None).compile().memory_analysis()
    cache = layer_scan.init_stacked_cache(cfg, B, S)
    cache_bytes = sum(x.nbytes for x in cache.kv)
    layer_weights = max(sum(leaf.nbytes for leaf in jax.tree.leaves(run)) // jax.tree.leaves(run)[0].shape[0]
                        for run in stacked["layer_runs"])
    scan, per_layer = memory(stacked, cache), memory(params, cache.unstacked())
    assert scan.alias_size_in_bytes >= cache_bytes
    extra = scan.temp_size_in_bytes - per_layer.temp_size_in_bytes
    assert extra <= cache_bytes // cfg.num_hidden_layers + layer_weights, (extra, cache_bytes, layer_weights)


def test_bad_combinations_raise_before_compute(params, stacked, cfg):
    toks = _tokens(cfg, (1, 4))
    cache = pdjax.init_cache(cfg, 1, 8)
    with pytest.raises(ValueError, match="StackedKVCache"):
        pdjax.decode_step(stacked, cfg, toks[:, 0], cache)
    s_cache = layer_scan.init_stacked_cache(cfg, 1, 8)
    with pytest.raises(ValueError, match="stacked params"):
        pdjax.decode_step(params, cfg, toks[:, 0], s_cache)
    with pytest.raises(ValueError, match="layer run 0"):           # cfg with another dense/MoE split
        pdjax.forward(stacked, cfg.replace(first_k_dense_replace=2), toks)
    with pytest.raises(ValueError, match="layer runs"):
        pdjax.forward(stacked, cfg.replace(n_routed_experts=0), toks)
    with pytest.raises(ValueError, match="mesh= takes per-layer params"):
        pdjax.forward(stacked, cfg, toks, mesh=jax.make_mesh((8,), ("expert",)))
    with pytest.raises(ValueError, match="already stacked"):
        stack_layers(stacked, cfg)
    with pytest.raises(ValueError, match="layer 1 is MoE in params but dense"):
        stack_layers(params, cfg.replace(first_k_dense_replace=2))

    class OwnLoop:
        def run_layers(self, *args):
            raise AssertionError("not reached")
    with pytest.raises(ValueError, match="own layer loop"):
        pdjax.forward(stacked, cfg, toks, moe_impl=OwnLoop())


def test_bf16_stacked_decode_matches_per_layer_without_float32_stacks():
    """bf16 stacked params and cache: a prefill and decode steps are as close to the float32
    model (the same bf16-rounded weights) as the per-layer path's (within 2x its error: the two
    bf16 programs round in different orders; dense layers, so no near-tie routing flips), and
    the compiled step stores no float32 copy of a weight stack or of the cache's run buffer.
    (XLA:CPU slices or updates a narrow float on a float32 copy of the whole array: the scan
    sliced each layer's weights out of a float32 copy of every stack, made each step, until
    the stacks were sliced as their bits.)"""
    cfg = pdjax.configs.tiny(n_routed_experts=0, num_hidden_layers=3)
    cfg16 = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    p16 = pdjax.init_params(cfg16, jax.random.key(0))
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, p16)
    s16 = stack_layers(p16, cfg16)
    toks = _tokens(cfg, (2, 5))
    logits = []
    for p, c in ((p32, cfg), (p16, cfg16), (s16, cfg16)):
        lg, cache = pdjax.prefill(p, c, toks, max_len=MAX_LEN)
        steps = [lg[:, -1]]
        for t in range(3):
            lg, cache = pdjax.decode_step(p, c, toks[:, t], cache)
            steps.append(lg)
        logits.append(np.asarray(jnp.stack(steps), np.float32))
    ref, per_layer, scan = logits
    assert np.abs(scan - ref).max() <= 2 * np.abs(per_layer - ref).max()
    cache = layer_scan.init_stacked_cache(cfg16, 2, MAX_LEN)
    hlo = transformer._decode_step.lower(s16, cfg16, jnp.zeros((2,), jnp.int32), cache, None).compile().as_text()
    stacks = {tuple(x.shape) for x in jax.tree.leaves((s16["layer_runs"], cache.kv)) if x.ndim >= 3}
    f32 = {shape for dtype, shape in stored_arrays(hlo) if dtype == "f32"}
    assert not f32 & stacks, f32 & stacks
