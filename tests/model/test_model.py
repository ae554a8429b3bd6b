"""The single-device model: cache paths against the no-cache forward, MLA absorbed vs
naive, chunked prefill, ragged generation, bad inputs."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.model import mla
from pdjax.model.cache import init_cache

TOL = 1e-5


def _tokens(cfg, shape, seed=0):
    return np.random.RandomState(seed).randint(0, cfg.vocab_size, shape).astype(np.int32)


@pytest.fixture(scope="module")
def ref(tiny_cfg, tiny_params):
    toks = _tokens(tiny_cfg, (3, 14))
    return toks, np.asarray(pdjax.forward(tiny_params, tiny_cfg, toks))


def test_absorbed_attention_equals_naive(tiny_cfg, tiny_params):
    cfg, p = tiny_cfg, tiny_params["layers"][1]["attn"]
    B, T, S = 2, 3, 11
    rng = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(rng[0], (B, T, cfg.hidden_size))
    kv = jax.random.normal(rng[1], (B, S, cfg.kv_latent_dim))
    q_pos = jnp.array([[5, 6, 7], [8, 9, 10]])
    cos, sin = mla.rope_cos_sin(cfg, q_pos)
    q_nope, q_pe = mla.project_q(p, cfg, x, cos, sin)
    mask = mla.causal_mask(q_pos, S)
    naive = mla.attend_naive(p, cfg, q_nope, q_pe, kv, mask)
    absorbed = mla.attend_absorbed(p, cfg, q_nope, q_pe, kv, mask)
    assert naive.shape == (B, T, cfg.num_attention_heads, cfg.v_head_dim)
    np.testing.assert_allclose(absorbed, naive, atol=TOL, rtol=0)


def test_prefill_absorbed_equals_naive(tiny_cfg, tiny_params, ref):
    toks, _ = ref
    a, _ = pdjax.prefill(tiny_params, tiny_cfg, toks, max_len=20, absorbed=True)
    n, _ = pdjax.prefill(tiny_params, tiny_cfg, toks, max_len=20, absorbed=False)
    np.testing.assert_allclose(a, n, atol=TOL, rtol=0)


def test_prefill_then_decode_reproduces_forward(tiny_cfg, tiny_params, ref):
    toks, full = ref
    P = 5
    logits, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :P], max_len=toks.shape[1])
    np.testing.assert_allclose(logits, full[:, :P], atol=TOL, rtol=0)
    for t in range(P, toks.shape[1]):
        step, cache = pdjax.decode_step(tiny_params, tiny_cfg, toks[:, t], cache)
        np.testing.assert_allclose(step, full[:, t], atol=TOL, rtol=0, err_msg=f"position {t}")
    assert np.asarray(cache.lengths).tolist() == [toks.shape[1]] * toks.shape[0]


def test_cache_holds_only_latent_and_rope_key(tiny_cfg, tiny_params, ref):
    toks, _ = ref
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, toks, max_len=16)
    cfg = tiny_cfg
    assert len(cache.kv) == cfg.num_hidden_layers
    assert cache.stacked().shape == (cfg.num_hidden_layers, 3, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache.nbytes_per_token() == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_two_chunk_prefill_equals_one_chunk(tiny_cfg, tiny_params, ref):
    toks, _ = ref
    one, c_one = pdjax.prefill(tiny_params, tiny_cfg, toks, max_len=16)
    first, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, :6], max_len=16)
    second, cache = pdjax.prefill(tiny_params, tiny_cfg, toks[:, 6:], cache=cache)
    np.testing.assert_allclose(np.concatenate([first, second], 1), one, atol=TOL, rtol=0)
    T = toks.shape[1]
    np.testing.assert_allclose(cache.stacked()[:, :, :T], c_one.stacked()[:, :, :T], atol=TOL, rtol=0)
    np.testing.assert_array_equal(cache.lengths, c_one.lengths)


def test_ragged_prompts_generate_like_single_prompts(tiny_cfg, tiny_params):
    prompts = [list(_tokens(tiny_cfg, (n,), seed=n)) for n in (1, 7, 4)]
    out = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=6)
    for p, o in zip(prompts, out):
        single = pdjax.generate(tiny_params, tiny_cfg, np.asarray([p]), max_new_tokens=6)
        assert p + o == single[0].tolist() and len(o) == 6     # a list gives the new tokens only


def test_generate_is_greedy_over_forward(tiny_cfg, tiny_params):
    prompt = _tokens(tiny_cfg, (2, 5), seed=3)
    out = pdjax.generate(tiny_params, tiny_cfg, prompt, max_new_tokens=4)
    seq = prompt
    for _ in range(4):
        nxt = np.argmax(np.asarray(pdjax.forward(tiny_params, tiny_cfg, seq))[:, -1], -1)
        seq = np.concatenate([seq, nxt[:, None].astype(np.int32)], 1)
    np.testing.assert_array_equal(out, seq)


def test_causality_by_gradient(tiny_cfg, tiny_params):
    """d logits[t] / d embedding[s] is zero for s > t."""
    toks = _tokens(tiny_cfg, (1, 6), seed=4)
    from pdjax.model import transformer as tr

    def out_at(x_emb, t):
        q_pos = jnp.arange(6)[None]
        x = x_emb
        for lp in tiny_params["layers"]:
            x, _ = tr.layer(lp, tiny_cfg, x, q_pos)
        return tr.head(tiny_params, tiny_cfg, x)[0, t].sum()

    emb = tiny_params["embed"][toks]
    g = jax.jit(jax.grad(out_at), static_argnums=1)(emb, 2)
    assert float(jnp.abs(g[0, 3:]).max()) == 0.0
    assert float(jnp.abs(g[0, :3]).max()) > 0.0


# ---- bad input ---------------------------------------------------------------------------

def test_token_out_of_range(tiny_cfg, tiny_params):
    bad = np.array([[1, 2, tiny_cfg.vocab_size]])
    with pytest.raises(ValueError, match="outside"):
        pdjax.forward(tiny_params, tiny_cfg, bad)
    with pytest.raises(ValueError, match="outside"):
        pdjax.prefill(tiny_params, tiny_cfg, np.array([[-1, 2]]), max_len=4)


def test_prompt_longer_than_max_len(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="max_len"):
        pdjax.prefill(tiny_params, tiny_cfg, np.zeros((1, 9), np.int32), max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        pdjax.generate(tiny_params, tiny_cfg, np.zeros((1, 6), np.int32), max_new_tokens=4, max_len=8)


def test_chunk_past_cache_end_and_full_cache(tiny_cfg, tiny_params):
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, np.zeros((1, 6), np.int32), max_len=8)
    with pytest.raises(ValueError, match="exceeds max_len"):
        pdjax.prefill(tiny_params, tiny_cfg, np.zeros((1, 3), np.int32), cache=cache)
    _, cache = pdjax.prefill(tiny_params, tiny_cfg, np.zeros((1, 2), np.int32), cache=cache)
    with pytest.raises(ValueError, match="full"):
        pdjax.decode_step(tiny_params, tiny_cfg, np.zeros((1,), np.int32), cache)


def test_generate_bad_arguments(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="max_new_tokens"):
        pdjax.generate(tiny_params, tiny_cfg, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pdjax.generate(tiny_params, tiny_cfg, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(TypeError, match="integer"):
        pdjax.forward(tiny_params, tiny_cfg, np.zeros((1, 2), np.float32))


def test_cache_bounds(tiny_cfg):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        init_cache(tiny_cfg, 1, tiny_cfg.max_position_embeddings + 1)


@pytest.mark.parametrize("blocks", [2, 4])
def test_causal_block_skipping_equals_full_attention(tiny_cfg, tiny_params, blocks):
    cfg, p = tiny_cfg, tiny_params["layers"][1]["attn"]
    B, T = 2, 16
    rng = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(rng[0], (B, T, cfg.hidden_size))
    q_pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    cos, sin = mla.rope_cos_sin(cfg, q_pos)
    q_nope, q_pe = mla.project_q(p, cfg, x, cos, sin)
    kv = mla.project_kv_latent(p, cfg, x, cos, sin)
    mask = mla.causal_mask(q_pos, T)
    full = mla.attend_naive(p, cfg, q_nope, q_pe, kv, mask)
    np.testing.assert_allclose(mla.attend_naive(p, cfg, q_nope, q_pe, kv, mask, causal_blocks=blocks),
                               full, atol=TOL, rtol=0)


def test_init_into_shardings_equals_unsharded_init(tiny_cfg):
    """init_params(mesh=) makes the params in shard_params' placement, bit for bit the
    unsharded init's values (two layers, one dense and one MoE: a short compile)."""
    from pdjax.parallel import make_mesh, shard_params
    cfg = tiny_cfg.replace(num_hidden_layers=2)
    mesh = make_mesh({"data": 2, "expert": 4})
    got = pdjax.init_params(cfg, jax.random.key(0), mesh=mesh)
    want = shard_params(pdjax.init_params(cfg, jax.random.key(0)), cfg, mesh)
    chex.assert_trees_all_equal(got, want, strict=True)          # structure, shapes, dtypes, values
    jax.tree.map(lambda g, w: chex.assert_equal(g.sharding, w.sharding), got, want)
    assert sum(not g.sharding.is_fully_replicated for g in jax.tree.leaves(got)) == 3   # the experts


@pytest.mark.parametrize("prompts,max_new,err,says", [
    ([[2.9, 7]], 2, TypeError, "prompt 0 must hold integer token ids, got float64"),
    ([["5", 7]], 2, TypeError, "prompt 0 must hold integer token ids"),
    ([[1, 2], [[3, 4]]], 2, TypeError, "prompt 1 must be a flat list"),
    ([[True, 3]], 2, TypeError, "prompt 0 holds a bool"),
    ([[1, 2]], True, ValueError, "max_new_tokens must be an integer >= 1, got True"),
    ([[1, 2]], 2.0, ValueError, "max_new_tokens must be an integer >= 1, got 2.0"),
])
def test_generate_coerces_nothing(tiny_cfg, tiny_params, prompts, max_new, err, says):
    """Prompts and counts are checked, never rounded, parsed or cast (before any compute)."""
    with pytest.raises(err, match=re.escape(says)):
        pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=max_new)
