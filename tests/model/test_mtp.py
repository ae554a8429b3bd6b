"""DeepSeek-V3's multi-token prediction: the MTP module's params, pdjax.loss with
mtp_weight, and greedy generation with MTP drafts (speculative="mtp") giving exactly the
tokens of plain greedy generation."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from mtp_models import perfect_drafter
from pdjax.model import mla, mtp
from pdjax.model import transformer as tfm
from pdjax.param_counts import param_counts


@pytest.fixture(scope="module")
def cfg():
    return pdjax.configs.tiny(num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def params(cfg):
    return pdjax.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens(cfg):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12), dtype=np.int32)


def test_the_mtp_params_are_apart_and_leave_the_model_as_it_was(cfg, params):
    assert len(params["mtp"]) == 1 and set(params["mtp"][0]) == {"enorm", "hnorm", "eh_proj", "layer", "head_norm"}
    assert params["mtp"][0]["eh_proj"].shape == (2 * cfg.hidden_size, cfg.hidden_size)
    assert "moe" in params["mtp"][0]["layer"]                     # layer index 3 of a tiny config: MoE
    plain = pdjax.init_params(cfg.replace(num_nextn_predict_layers=0), jax.random.key(0))
    assert "mtp" not in plain
    same = jax.tree.map(lambda a, b: bool((a == b).all()), plain, {k: v for k, v in params.items() if k != "mtp"})
    assert all(jax.tree.leaves(same))
    assert sum(x.size for x in jax.tree.leaves(params["mtp"])) == param_counts(cfg).mtp
    assert param_counts(cfg).total == param_counts(cfg.replace(num_nextn_predict_layers=0)).total
    v3 = param_counts(pdjax.configs.deepseek_v3())
    assert v3.mtp_layers == 1 and round(v3.total / 1e9) == 671


# jitted (the same computations; run eagerly, a MoE model dispatches op by op: seconds each)
_loss = jax.jit(pdjax.loss, static_argnums=(1,), static_argnames=("mtp_weight",))
_run_layers = jax.jit(tfm.run_layers, static_argnums=(1,))
_layer = jax.jit(tfm.layer, static_argnums=(1,))


def _mtp_reference(params, cfg, tokens):
    """Depth 1's mean cross-entropy, position by position, from the definitions (one row and
    one position at a time; the model's normed state from pdjax.forward's pieces)."""
    B, T = tokens.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, _ = _run_layers(params, cfg, tfm.embed(params, tokens, cfg), q_pos)
    g = np.asarray(mla.rms_norm(x, params["final_norm"], cfg.rms_norm_eps))
    p = params["mtp"][0]
    emb = np.asarray(params["embed"])[tokens]

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(w)
    h = np.concatenate([norm(emb[:, 1:], p["enorm"]), norm(g[:, :-1], p["hnorm"])], -1) @ np.asarray(p["eh_proj"])
    y, _ = _layer(p["layer"], cfg, jnp.asarray(h), q_pos[:, :T - 1])
    logits = norm(np.asarray(y), p["head_norm"]) @ np.asarray(params["lm_head"])
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    picked = [logp[b, i, tokens[b, i + 2]] for b in range(B) for i in range(T - 2)]
    return -np.mean(picked)


def test_loss_is_the_model_cross_entropy_plus_lambda_times_the_mtp_one(cfg, params, tokens):
    plain_cfg = cfg.replace(num_nextn_predict_layers=0)
    plain = {k: v for k, v in params.items() if k != "mtp"}
    logits = np.asarray(pdjax.forward(plain, plain_cfg, tokens), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    main = -np.mean([logp[b, i, tokens[b, i + 1]] for b in range(2) for i in range(11)])
    np.testing.assert_allclose(_loss(plain, plain_cfg, tokens), main, rtol=1e-5)
    np.testing.assert_allclose(_loss(params, cfg, tokens), main, rtol=1e-5)     # mtp_weight=0: no MTP term
    ref = _mtp_reference(params, cfg, tokens)
    np.testing.assert_allclose(_loss(params, cfg, tokens, mtp_weight=0.3), main + 0.3 * ref, rtol=1e-5)


def test_the_mtp_weight_reaches_the_mtp_params_through_the_gradient(cfg, params, tokens):
    g0 = jax.jit(jax.grad(lambda p: pdjax.loss(p, cfg, tokens)))(params)
    g1 = jax.jit(jax.grad(lambda p: pdjax.loss(p, cfg, tokens, mtp_weight=0.3)))(params)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(g0["mtp"]))
    assert float(jnp.abs(g1["mtp"][0]["eh_proj"]).max()) > 0
    assert float(jnp.abs(g1["embed"] - g0["embed"]).max()) > 0            # the shared embedding learns from it


@pytest.mark.parametrize("call, match", [
    (lambda p, c, t: pdjax.loss({k: v for k, v in p.items() if k != "mtp"}, c.replace(num_nextn_predict_layers=0),
                                t, mtp_weight=0.3), "mtp_weight=0.3 needs the MTP modules"),
    (lambda p, c, t: pdjax.loss(p, c, t[:, :2], mtp_weight=0.3), "at least 3 tokens"),
    (lambda p, c, t: pdjax.loss(p, c, t, mtp_weight=-1.0), "mtp_weight must be >= 0"),
    (lambda p, c, t: pdjax.loss(p, c, t, mtp_weight=float("nan")), "mtp_weight must be finite"),
    (lambda p, c, t: pdjax.generate(p, c.replace(num_nextn_predict_layers=0), [[1, 2]], max_new_tokens=3,
                                    speculative="mtp"), "speculative='mtp' needs an MTP module"),
    (lambda p, c, t: pdjax.generate(p, c, [[1, 2]], max_new_tokens=3, speculative="eagle"),
     "speculative must be None or 'mtp'"),
    (lambda p, c, t: pdjax.generate(p, c, [[1, 2]], max_new_tokens=3, speculative="mtp", max_len=6),
     r"prompt \(2\) \+ max_new_tokens \(3\) \+ 2 exceeds max_len=6"),
])
def test_bad_input_is_refused_naming_the_problem(cfg, params, tokens, call, match):
    with pytest.raises(ValueError, match=match):
        call(params, cfg, tokens)


PROMPTS = [[5, 9, 200, 31, 7, 7, 64], [3], [250, 1, 2, 3]]


def test_mtp_drafts_change_nothing_in_the_tokens(cfg, params):
    """A random MTP module (every draft rejected: the stale row of each step is overwritten),
    a perfect one (every draft accepted: two tokens a step), and a perturbed perfect one
    (some of each): always plain greedy's tokens, ragged prompts included."""
    pcfg, perfect = perfect_drafter(cfg)
    noisy = dict(perfect, mtp=[dict(perfect["mtp"][0], head_norm=perfect["final_norm"]
                                     * jax.random.uniform(jax.random.key(2), (cfg.hidden_size,), minval=0.0))])
    rates = []
    for c, p in ((cfg, params), (pcfg, perfect), (pcfg, noisy)):
        want = pdjax.generate(p, c, PROMPTS, max_new_tokens=10)
        got, stats = pdjax.generate(p, c, PROMPTS, max_new_tokens=10, speculative="mtp", return_stats=True)
        assert stats["near_ties"] == 0 and got == want
        assert stats["tokens_per_step"] == pytest.approx(1 + stats["accept_rate"])
        rates.append(stats["accept_rate"])
    assert rates[0] < 0.2 and rates[1] == 1.0 and 0.0 < rates[2] < 1.0, rates
    arr = np.array([PROMPTS[0][:4], PROMPTS[2]])
    got = pdjax.generate(perfect, pcfg, arr, max_new_tokens=6, speculative="mtp")
    np.testing.assert_array_equal(got, pdjax.generate(perfect, pcfg, arr, max_new_tokens=6))


def test_a_perfect_drafter_halves_the_decode_steps(cfg, params):
    pcfg, perfect = perfect_drafter(cfg)
    _, stats = pdjax.generate(perfect, pcfg, [[1, 2, 3]], max_new_tokens=9, speculative="mtp", return_stats=True)
    # the prefill gives token 1, each step two more: 8 more tokens in 4 steps
    assert stats == {"accept_rate": 1.0, "tokens_per_step": 2.0, "steps": 4, "drafts": 4, "near_ties": 0}
    _, plain = pdjax.generate(perfect, pcfg, [[1, 2, 3]], max_new_tokens=9, return_stats=True)
    assert plain == {"accept_rate": None, "tokens_per_step": 1.0, "steps": 8, "drafts": 0, "near_ties": None}


def test_near_ties_are_counted():
    """A model whose logits are all equal (final norm zero): every emitted token is a tie."""
    cfg = pdjax.configs.tiny(num_nextn_predict_layers=1)
    p = pdjax.init_params(cfg, jax.random.key(5))
    p = dict(p, final_norm=jnp.zeros_like(p["final_norm"]))
    out, stats = pdjax.generate(p, cfg, [[1, 2]], max_new_tokens=5, speculative="mtp", return_stats=True)
    assert out == [[0] * 5] and stats["near_ties"] == 5


def test_mtp_logits_match_the_definition_at_every_depth():
    """Two depths: depth 2 reads depth 1's normed output and the embedding two ahead."""
    cfg = pdjax.configs.tiny(num_nextn_predict_layers=2)
    p = pdjax.init_params(cfg, jax.random.key(3))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 8), dtype=np.int32)
    q_pos = jnp.arange(8, dtype=jnp.int32)[None]
    x, _ = _run_layers(p, cfg, tfm.embed(p, tokens, cfg), q_pos)
    g = tfm.final_hidden(p, cfg, x)
    out = jax.jit(mtp.mtp_logits, static_argnums=(1, 4))(p, cfg, g, tokens, tfm.layer)
    assert [o.shape for o in out] == [(1, 7, cfg.vocab_size), (1, 6, cfg.vocab_size)]
    block = jax.jit(mtp.depth_block, static_argnums=(1, 5))
    g1, _ = block(p["mtp"][0], cfg, p["embed"][tokens[:, 1:]], g[:, :7], q_pos[:, :7], tfm.layer)
    g2, _ = block(p["mtp"][1], cfg, p["embed"][tokens[:, 2:]], g1[:, :6], q_pos[:, :6], tfm.layer)
    np.testing.assert_allclose(out[1], tfm.logits_of(p, g2), rtol=1e-6, atol=1e-6)
    assert p["mtp"][0]["layer"]["moe"]["w_up"].shape != () and "moe" in p["mtp"][1]["layer"]


# ---- against an independent implementation: transformers' DeepseekV3 layer (scripts/make_mtp_fixture.py)

MTP_CKPT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "deepseek_v3_mtp_tiny")


@pytest.fixture(scope="module")
def v3_mtp():
    cfg, params = pdjax.load_hf(MTP_CKPT)
    return cfg, params, dict(np.load(os.path.join(MTP_CKPT, "reference.npz")))


def test_a_v3_checkpoint_loads_its_mtp_layer_exact_to_the_reference(v3_mtp):
    """The MTP layer of a V3 checkpoint (layer num_hidden_layers, its copies of the embedding
    and head equal to the model's) loads into params["mtp"], and depth 1's logits equal
    those of transformers' DeepseekV3DecoderLayer run on [enorm(embed(t[i+1])); hnorm(h_i)]."""
    cfg, params, ref = v3_mtp
    assert cfg.num_nextn_predict_layers == 1 and len(params["mtp"]) == 1
    tokens = ref["tokens"]
    T = tokens.shape[1]
    x, _ = _run_layers(params, cfg, tfm.embed(params, tokens, cfg), jnp.broadcast_to(jnp.arange(T), (2, T)))
    g = tfm.final_hidden(params, cfg, x)
    np.testing.assert_allclose(g, ref["main_hidden_normed"], atol=1e-5)
    logits = jax.jit(mtp.mtp_logits, static_argnums=(1, 4))(params, cfg, g, tokens, tfm.layer)
    np.testing.assert_allclose(logits[0], ref["mtp_logits"], atol=1e-5)


def test_the_mtp_loss_of_a_v3_checkpoint_is_the_reference_cross_entropy(v3_mtp):
    cfg, params, ref = v3_mtp
    tokens = ref["tokens"]

    def ce(logits, targets):
        logits = logits.astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        return np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    main = ce(ref["logits"][:, :-1], tokens[:, 1:])
    depth1 = ce(ref["mtp_logits"][:, :-1], tokens[:, 2:])
    np.testing.assert_allclose(pdjax.loss(params, cfg, tokens, mtp_weight=0.3), main + 0.3 * depth1, rtol=2e-6)


def test_save_and_load_keep_the_mtp_layer_and_refuse_copies_that_differ(v3_mtp, tmp_path):
    from safetensors.numpy import load_file, save_file

    cfg, params, _ = v3_mtp
    pdjax.save_hf(str(tmp_path / "a"), params, cfg)
    cfg2, back = pdjax.load_hf(str(tmp_path / "a"))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)
    shard = tmp_path / "a" / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.3.shared_head.head.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][5, 7] += 1.0
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=f"tensor {name} of checkpoint .* differs from lm_head.weight"):
        pdjax.load_hf(str(tmp_path / "a"))
    cfg0, plain = pdjax.load_hf(str(tmp_path / "a"), mtp=False)
    assert cfg0.num_nextn_predict_layers == 0 and "mtp" not in plain
