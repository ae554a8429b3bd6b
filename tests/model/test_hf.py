"""Hugging Face checkpoints: logits against transformers' DeepseekV2/V3 (committed fixtures
made by scripts/make_hf_fixtures.py), both config.json forms, round trips, bad files."""

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdjax
from pdjax.model import hf

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
MODELS = ["deepseek_v2_tiny", "deepseek_v3_tiny"]


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(HF, name), dst)
    return dst


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("config_form", ["config.json", "config.legacy.json"])
def test_logits_match_transformers(name, config_form, tmp_path):
    path = os.path.join(HF, name)
    if config_form != "config.json":
        path = _copy(name, tmp_path)
        shutil.copy(path / config_form, path / "config.json")
    cfg, params = pdjax.load_hf(str(path))
    ref = np.load(os.path.join(HF, name, "reference.npz"))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor > 1
    logits = pdjax.forward(params, cfg, ref["tokens"])
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_routing_matches_transformers(name):
    """The experts chosen in each MoE layer equal the reference's, token by token."""
    from pdjax.model import mla, moe
    from pdjax.model.transformer import attention
    cfg, params = pdjax.load_hf(os.path.join(HF, name))
    ref = np.load(os.path.join(HF, name, "reference.npz"))
    hidden = ref["hidden_states"]            # embeddings, then each layer's output
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        lp = params["layers"][i]
        x = jnp.asarray(hidden[i])           # input of layer i
        q_pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
        a, _ = attention(lp, cfg, mla.rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), q_pos)
        h = mla.rms_norm(x + a, lp["ffn_norm"], cfg.rms_norm_eps)
        w, idx = moe.gate(lp["moe"], cfg, h.reshape(-1, cfg.hidden_size))
        order = np.argsort(np.asarray(idx), -1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                      ref[f"topk_indices_layer{i}"])
        np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                                   ref[f"topk_weights_layer{i}"], atol=1e-5)


def test_save_hf_round_trip_sharded(tiny_cfg, tiny_params, tmp_path):
    hf.save_hf(str(tmp_path / "ckpt"), tiny_params, tiny_cfg, max_shard_bytes=200_000)
    files = os.listdir(tmp_path / "ckpt")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    cfg, params = pdjax.load_hf(str(tmp_path / "ckpt"))
    assert cfg == tiny_cfg
    chex.assert_trees_all_equal(params, tiny_params, strict=True)


def test_fp8_block_dequantisation(tmp_path):
    import ml_dtypes  # a jax dependency
    from safetensors.numpy import load_file, save_file
    src = _copy("deepseek_v3_tiny", tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    shard = json.load(open(src / "model.safetensors.index.json"))["weight_map"][name]
    tensors = load_file(src / shard)
    w = tensors[name]
    scale = np.array([[0.5]], np.float32)           # one 128x128 block covers the tensor
    q = (w / scale[0, 0]).astype(ml_dtypes.float8_e4m3fn)
    tensors[name] = q
    tensors[name + "_scale_inv"] = scale
    save_file(tensors, src / shard)
    _, params = pdjax.load_hf(str(src))
    want = q.astype(np.float32) * scale[0, 0]
    np.testing.assert_array_equal(params["layers"][0]["mlp"]["w_gate"], want.T)


def test_orbax_round_trip_onto_sharding(tiny_params, tmp_path):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pdjax.save_params(str(tmp_path / "p"), tiny_params)
    restored = pdjax.restore_params(str(tmp_path / "p"), like=tiny_params, sharding=replicated)
    leaves = jax.tree.leaves(restored)
    assert all(x.sharding == replicated for x in leaves)
    chex.assert_trees_all_equal(restored, tiny_params, strict=True)


# ---- bad checkpoints ---------------------------------------------------------------------

def test_malformed_config_json(tmp_path):
    src = _copy("deepseek_v2_tiny", tmp_path)
    (src / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ValueError, match="malformed config.json"):
        pdjax.load_hf(str(src))
    (src / "config.json").write_text(json.dumps({**json.load(open(src / "config.legacy.json")),
                                                  "n_group": 3}))
    with pytest.raises(ValueError, match="n_group"):
        pdjax.load_hf(str(src))


def test_truncated_safetensors(tmp_path):
    src = _copy("deepseek_v2_tiny", tmp_path)
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated safetensors file .*model.safetensors"):
        pdjax.load_hf(str(src))
    f.write_bytes(data[:5])
    with pytest.raises(ValueError, match="truncated"):
        pdjax.load_hf(str(src))


def _rewrite(src, fn):
    from safetensors.numpy import load_file, save_file
    t = load_file(src / "model.safetensors")
    fn(t)
    save_file(t, src / "model.safetensors")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    src = _copy("deepseek_v2_tiny", tmp_path)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite(src, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        pdjax.load_hf(str(src))
    src = _copy("deepseek_v2_tiny", tmp_path / "b")
    _rewrite(src, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(2, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.mlp.extra.weight"):
        pdjax.load_hf(str(src))
    src = _copy("deepseek_v2_tiny", tmp_path / "c")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _rewrite(src, lambda t: t.update({name: t[name][:, :-1].copy()}))
    with pytest.raises(ValueError, match=f"tensor {name} has shape"):
        pdjax.load_hf(str(src))


def test_mtp_layers_left_out_on_request(tmp_path):
    """A declared MTP layer that is not a whole one (an eh_proj alone) fails the load naming
    what it lacks; load_hf(mtp=False) reads the model without it."""
    src = _copy("deepseek_v2_tiny", tmp_path)
    _rewrite(src, lambda t: t.update({"model.layers.3.eh_proj.weight": np.zeros((2, 2), np.float32)}))
    # only the multi-token-prediction layers config.json declares may follow the decoder's
    (src / "config.json").write_text(json.dumps({**json.load(open(src / "config.json")),
                                                  "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match="layer 3 of checkpoint .* holds 0 routed experts"):
        pdjax.load_hf(str(src))
    cfg, params = pdjax.load_hf(str(src), mtp=False)
    assert cfg.num_nextn_predict_layers == 0 and "mtp" not in params


# ---- dtype and placement ---------------------------------------------------------------------

def test_load_keeps_the_stored_dtype(tmp_path):
    """A bf16 checkpoint loads as bf16 (router bias float32, as HF keeps it), cfg.param_dtype
    says so, and dtype= converts it."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file
    src = _copy("deepseek_v3_tiny", tmp_path)
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        save_file({k: v if k.endswith("e_score_correction_bias") else v.astype(ml_dtypes.bfloat16)
                   for k, v in tensors.items()}, shard)
    cfg32, params32 = pdjax.load_hf(os.path.join(HF, "deepseek_v3_tiny"))
    cfg, params = pdjax.load_hf(str(src))
    assert cfg.param_dtype == "bfloat16" and cfg == cfg32.replace(param_dtype="bfloat16")

    def check(path, x, x32):
        want = jnp.float32 if path[-1].key == "router_bias" else jnp.bfloat16
        assert x.dtype == want, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(x32).astype(want))
    jax.tree_util.tree_map_with_path(check, params, params32)
    cfg_up, up = pdjax.load_hf(str(src), dtype="float32")
    assert cfg_up == cfg32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(up))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b).astype(np.float32)), up, params)


def test_load_onto_a_mesh_places_like_shard_params(monkeypatch):
    """load_hf(mesh=) puts every tensor on the sharding shard_params gives, with the values of
    the unsharded load, and each process reads only its own experts, each once however many
    of its devices hold it (the data axis' replicas)."""
    from pdjax.parallel import make_mesh, shard_params
    path = os.path.join(HF, "deepseek_v3_tiny")
    cfg, params = pdjax.load_hf(path)
    mesh = make_mesh({"data": 2, "expert": 4})
    want = shard_params(params, cfg, mesh)
    reads: dict[str, int] = {}
    real_get = hf.SafetensorsFile.get

    def counting_get(self, name):
        reads[name] = reads.get(name, 0) + 1
        return real_get(self, name)
    monkeypatch.setattr(hf.SafetensorsFile, "get", counting_get)
    cfg_m, got = pdjax.load_hf(path, mesh=mesh)
    assert cfg_m == cfg
    jax.tree.map(lambda g, w: chex.assert_equal(g.sharding, w.sharding), got, want)
    chex.assert_trees_all_equal(got, params, strict=True)        # structure, shapes, dtypes, values
    sharded = [g for g in jax.tree.leaves(got) if not g.sharding.is_fully_replicated]
    assert len(sharded) == 3 * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
    expert_reads = {n: c for n, c in reads.items() if ".experts." in n}
    assert len(expert_reads) == 3 * cfg.n_routed_experts * (cfg.num_hidden_layers - cfg.first_k_dense_replace)
    assert set(expert_reads.values()) == {1}
