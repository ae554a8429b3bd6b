"""DeepSeek-V3.2's sparse attention (DSA): exact to transformers' DeepseekV32ForCausalLM on a
tiny checkpoint where the indexer's top-k changes the logits (scripts/make_dsa_fixture.py),
and a decode that reads only the selected rows."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.model import dsa, hf, mla

CKPT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "deepseek_v32_tiny")


@pytest.fixture(scope="module")
def v32():
    cfg, params = pdjax.load_hf(CKPT)
    return cfg, params, dict(np.load(os.path.join(CKPT, "reference.npz")))


def test_the_fixture_selects_sparsely_and_far_from_a_tie(v32):
    """index_topk 4 of 12 tokens: sparse logits differ from dense ones by far more than the
    tolerance, and no query's k-th and (k+1)-th index scores are near a tie."""
    cfg, _, ref = v32
    assert cfg.model_type == "deepseek_v32" and cfg.sparse_attention and cfg.index_topk < ref["tokens"].shape[1]
    assert np.abs(ref["logits"] - ref["dense_logits"]).max() > 0.1
    assert ref["topk_margin"] > 1e-3


def test_forward_equals_transformers(v32):
    cfg, params, ref = v32
    np.testing.assert_allclose(pdjax.forward(params, cfg, ref["tokens"]), ref["logits"], atol=1e-4, rtol=0)
    dense = pdjax.forward(params, cfg.replace(index_topk=ref["tokens"].shape[1]), ref["tokens"])
    np.testing.assert_allclose(dense, ref["dense_logits"], atol=1e-4, rtol=0)


def test_prefill_and_decode_steps_equal_transformers(v32):
    """A cached prefill of 8 tokens, then 4 one-token steps (absorbed MLA over only the rows
    the indexer selects, the cache holding the indexer's keys beside the latents)."""
    cfg, params, ref = v32
    tokens = ref["tokens"]
    logits, cache = pdjax.prefill(params, cfg, tokens[:, :8], max_len=16)
    np.testing.assert_allclose(logits, ref["logits"][:, :8], atol=1e-4, rtol=0)
    assert cache.kv[0].shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
    steps = []
    for t in range(8, 12):
        step, cache = pdjax.decode_step(params, cfg, tokens[:, t], cache)
        steps.append(step)
    np.testing.assert_allclose(np.stack(steps, 1), ref["decode_logits"], atol=1e-4, rtol=0)


def test_a_checkpoint_round_trips(v32, tmp_path):
    cfg, params, _ = v32
    hf.save_hf(str(tmp_path / "v32"), params, cfg)
    cfg2, params2 = pdjax.load_hf(str(tmp_path / "v32"))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


@pytest.mark.parametrize("overrides, says", [
    (dict(index_topk=4), "all 0 or all positive"),
    (dict(index_n_heads=4, index_head_dim=16, index_topk=-1), "all 0 or all positive"),
    (dict(index_n_heads=4, index_head_dim=4, index_topk=4), "index_head_dim=4 must be >= qk_rope_head_dim"),
    (dict(index_n_heads=4, index_head_dim=16, index_topk=4, q_lora_rank=None), "needs q_lora_rank"),
])
def test_bad_sparse_attention_configs_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        pdjax.configs.tiny(**overrides)


def test_the_released_config():
    cfg = pdjax.configs.deepseek_v32()
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.kv_latent_dim == 512 + 64 + 128 and cfg.mla_latent_dim == 576


# ---- what a decode step reads ---------------------------------------------------------------

SPARSE = pdjax.configs.tiny(kv_lora_rank=128, qk_rope_head_dim=32, index_n_heads=8, index_head_dim=32,
                            index_topk=64, model_type="deepseek_v32", num_hidden_layers=1)


def _bytes(f, *shapes) -> float:
    """Bytes the program reads and writes as written (the cost analysis of the lowered module:
    XLA:CPU fuses a gather with its neighbours into a loop fusion whose compiled cost analysis
    charges the whole gathered-from operand, an accounting artefact; unfused, a gather counts
    the rows it gathers)."""
    cost = jax.jit(f).lower(*shapes).cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]


def _decode_bytes(S: int, k: int = SPARSE.index_topk) -> dict:
    """Bytes of one query's sparse attention (given its k selected rows), its dense absorbed
    attention, and its indexer, over a cache of S rows."""
    cfg, sds, f32 = SPARSE, jax.ShapeDtypeStruct, jnp.float32
    p = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))["layers"][0]["attn"]
    H, R = cfg.num_attention_heads, cfg.qk_rope_head_dim
    q_nope, q_pe = sds((1, 1, H, cfg.qk_nope_head_dim), f32), sds((1, 1, H, R), f32)
    kv, mask = sds((1, S, cfg.kv_latent_dim), f32), sds((1, 1, S), bool)
    idx, valid = sds((1, 1, k), jnp.int32), sds((1, 1, k), bool)
    x, q_res = sds((1, 1, cfg.hidden_size), f32), sds((1, 1, cfg.q_lora_rank), f32)
    cos, keys = sds((1, 1, R // 2), f32), sds((1, S, cfg.index_head_dim), f32)
    return {"sparse": _bytes(lambda w, *a: dsa.attend_sparse(w, cfg, *a), p, q_nope, q_pe, kv, idx, valid),
            "dense": _bytes(lambda w, *a: mla.attend_absorbed(w, cfg, *a), p, q_nope, q_pe, kv, mask),
            "indexer": _bytes(lambda w, *a: dsa.index_scores(w, cfg, *a), p["indexer"], x, q_res, cos, cos, keys,
                              mask)}


def test_decode_reads_only_the_selected_rows():
    """Given its selection, the sparse attention's bytes do not grow with the context (16x
    more rows: the same bytes) but with k; dense absorbed MLA's grow with the context; the
    indexer's grow linearly with the context, by at least its key per token and by less than
    a dense attention's row per token (the released config: a key of 128 values against
    MLA's 576)."""
    b = {S: _decode_bytes(S) for S in (256, 1024, 4096)}
    assert b[256]["sparse"] == b[1024]["sparse"] == b[4096]["sparse"]
    assert _decode_bytes(1024, k=128)["sparse"] > 1.5 * b[1024]["sparse"]
    assert b[4096]["dense"] > 10 * b[256]["dense"]
    per_token = {kind: (b[4096][kind] - b[1024][kind]) / 3072 for kind in ("dense", "indexer")}
    assert (b[1024]["indexer"] - b[256]["indexer"]) / 768 == pytest.approx(per_token["indexer"], rel=0.02)
    assert SPARSE.index_head_dim * 4 <= per_token["indexer"] < per_token["dense"]


# ---- on a mesh ------------------------------------------------------------------------------

def test_sharded_as_v3(v32, tmp_path):
    """On a (data 2, expert 4) mesh (DP attention, EP; the indexer replicated like the
    attention): HF loading onto the mesh, generate on it, and an orbax round trip give the
    unsharded model's tokens and params."""
    from pdjax.parallel import make_mesh

    cfg, params, ref = v32
    mesh = make_mesh({"data": 2, "expert": 4})
    prompts = [list(map(int, ref["tokens"][i % 2, :n])) for i, n in enumerate((12, 7, 10, 12, 9, 5, 11, 12))]
    want = pdjax.generate(params, cfg, prompts, max_new_tokens=4)
    _, placed = pdjax.load_hf(CKPT, mesh=mesh)
    assert placed["layers"][1]["moe"]["w_up"].sharding.spec[0] == "expert"
    assert placed["layers"][1]["attn"]["indexer"]["wq_b"].sharding.is_fully_replicated
    assert pdjax.generate(placed, cfg, prompts, max_new_tokens=4, mesh=mesh) == want
    pdjax.save_params(str(tmp_path / "p"), placed)
    restored = pdjax.restore_params(str(tmp_path / "p"), like=placed)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
