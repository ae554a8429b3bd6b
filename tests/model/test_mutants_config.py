"""The parts of :mod:`pdjax.model_config` whose mistakes are silent and which the config's other
tests do not pin: the defaults a config.json may leave out, the dtype aliases, the derived
properties of a config (MoE layers, softmax scale, routed scaling) and ``to_hf_dict``'s
form. Found by mutation testing (docs/mutation.md)."""

import dataclasses

import pytest

import pdjax
from pdjax.model_config import ModelConfig, RopeScaling, from_hf_dict

NAN = float("nan")


def test_model_config_defaults_are_the_small_reference_model():
    """``ModelConfig()`` with no arguments is a valid small V3-shaped model with exactly these
    values (a config.json that leaves a key out falls back to them): float32 params and
    compute, the cache following compute, no rope scaling."""
    cfg = ModelConfig()
    want = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                first_k_dense_replace=1, moe_layer_freq=1, scoring_func="softmax", topk_method="greedy",
                norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096,
                rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
                num_nextn_predict_layers=0, index_n_heads=0, index_head_dim=0, index_topk=0,
                model_type="deepseek_v3", param_dtype="float32", compute_dtype="float32", cache_dtype=None)
    assert dataclasses.asdict(cfg) == want
    assert type(cfg.norm_topk_prob) is bool and cfg.kv_cache_dtype == "float32"


YARN_DEFAULTS = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                     mscale=1.0, mscale_all_dim=0.0, rope_type="yarn")


def test_rope_scaling_keys_left_out_take_deepseeks_yarn_defaults():
    """A rope_scaling that gives only its factor is YaRN with DeepSeek's reference defaults
    (original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1,
    mscale_all_dim 0): as a dict without a type on a ModelConfig, and from a config.json
    that names the type."""
    assert RopeScaling(factor=40.0).to_dict() == YARN_DEFAULTS
    assert pdjax.configs.tiny(rope_scaling={"factor": 40}).rope_scaling.to_dict() == YARN_DEFAULTS
    hf = {**pdjax.configs.tiny().to_hf_dict(), "rope_scaling": {"type": "yarn", "factor": 40}}
    assert from_hf_dict(hf).rope_scaling.to_dict() == YARN_DEFAULTS


ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16", "fp16": "float16",
           "half": "float16", "fp8": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
           "e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2", "float8_e4m3fn": "float8_e4m3fn"}


@pytest.mark.parametrize("alias", ALIASES)
def test_every_dtype_alias_names_its_dtype(alias):
    """Each short dtype name (and both float8 formats by their own names) is accepted for the
    cache and normalised to its canonical name."""
    assert pdjax.configs.tiny(cache_dtype=alias).kv_cache_dtype == ALIASES[alias]


def test_moe_layers_follow_expert_count_first_dense_and_frequency():
    """A config without routed experts has no MoE layer; otherwise layer i is MoE when
    i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    dense = pdjax.configs.tiny(n_routed_experts=0)
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_hidden_layers))
    cfg = pdjax.configs.tiny(num_hidden_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [2, 4]
    assert [i for i in range(3) if pdjax.configs.tiny().is_moe_layer(i)] == [1, 2]


def test_softmax_scale_without_rope_scaling_or_mscale_all_dim():
    """Without rope scaling, or with an mscale_all_dim of 0, the softmax scale is plain
    1/sqrt(qk_head_dim)."""
    for cfg in (pdjax.configs.tiny(rope_scaling=None),
                pdjax.configs.tiny(rope_scaling={"factor": 40.0, "mscale_all_dim": 0.0})):
        assert cfg.softmax_scale == cfg.qk_head_dim ** -0.5


def test_routed_scaling_is_always_applied_in_v3_only():
    """``routed_scaling_always`` is a bool property: True for DeepSeek-V3, False for V2."""
    assert pdjax.configs.deepseek_v3().routed_scaling_always is True
    assert pdjax.configs.deepseek_v2().routed_scaling_always is False


def test_to_hf_dict_holds_exactly_the_fields_and_hf_rope_scaling():
    """``to_hf_dict`` (what save_hf writes as config.json) holds one key per field and no
    other, rope_scaling as HF's object with its type (or null)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    d = pdjax.configs.tiny().to_hf_dict()
    assert set(d) == fields
    assert d["rope_scaling"]["type"] == "yarn" and d["rope_scaling"]["factor"] == 4.0
    d = pdjax.configs.tiny(rope_scaling=None).to_hf_dict()
    assert set(d) == fields and d["rope_scaling"] is None


def test_config_json_without_model_type_is_v3():
    """A config.json without ``model_type`` is read as DeepSeek-V3."""
    hf = pdjax.configs.tiny().to_hf_dict()
    del hf["model_type"]
    assert from_hf_dict(hf) == pdjax.configs.tiny()


def test_a_nan_rope_theta_beside_rope_parameters_is_refused():
    """A NaN rope_theta next to rope_parameters' own rope_theta is a contradiction (never
    silently replaced by the other); NaN in both is refused as not finite."""
    hf = {k: v for k, v in pdjax.configs.deepseek_v3().to_hf_dict().items() if k != "rope_scaling"}
    params = {"rope_type": "yarn", "factor": 40.0}
    with pytest.raises(ValueError, match="rope_theta=nan .* disagree"):
        from_hf_dict({**hf, "rope_theta": NAN, "rope_parameters": {**params, "rope_theta": 10000.0}})
    with pytest.raises(ValueError, match="rope_theta must be finite"):
        from_hf_dict({**hf, "rope_theta": NAN, "rope_parameters": {**params, "rope_theta": NAN}})


def test_the_notebook_view_is_one_div():
    """The notebook view of a config is one ``<div>`` holding the config table and the
    parameter counts."""
    page = pdjax.configs.tiny()._repr_html_()
    assert page.startswith("<div") and page.endswith("</table></div>")


# ---- pdjax.model_config_checks ----------------------------------------------------------------------

def test_intermediate_size_is_needed_only_where_a_layer_is_dense():
    """``intermediate_size`` must be positive when some layer is dense (a dense model, or a
    MoE model's first layers) and may be 0 when every layer is MoE."""
    assert pdjax.configs.tiny(first_k_dense_replace=0, intermediate_size=0).intermediate_size == 0
    for changes in (dict(intermediate_size=0), dict(n_routed_experts=0, intermediate_size=0)):
        with pytest.raises(ValueError, match="intermediate_size must be a positive integer"):
            pdjax.configs.tiny(**changes)


def test_moe_fields_at_their_boundaries_are_accepted():
    """No routed experts (a dense model), no shared experts, top-k equal to the expert count
    (one group), and top-k equal to what the chosen groups hold are valid configs."""
    assert pdjax.configs.tiny(n_routed_experts=0).n_routed_experts == 0
    assert pdjax.configs.tiny(n_shared_experts=0).n_shared_experts == 0
    cfg = pdjax.configs.tiny(num_experts_per_tok=8, n_group=1, topk_group=1)
    assert cfg.num_experts_per_tok == cfg.n_routed_experts == 8
    cfg = pdjax.configs.tiny(n_group=4, topk_group=1, num_experts_per_tok=2)    # 1 group of 2 experts
    assert cfg.topk_group * cfg.n_routed_experts // cfg.n_group == cfg.num_experts_per_tok


def test_a_numpy_q_lora_rank_is_stored_as_an_int():
    """``q_lora_rank`` given as a numpy integer is stored as a Python int, like every other
    count (config.json writes it)."""
    import numpy as np

    cfg = pdjax.configs.tiny(q_lora_rank=np.int64(32))
    assert type(cfg.q_lora_rank) is int and cfg == pdjax.configs.tiny()


def test_noaux_tc_needs_two_experts_in_each_of_two_groups():
    """noaux_tc scores a group by its top two experts: two groups of one expert each are
    refused; one group of one expert is not grouped and is valid."""
    with pytest.raises(ValueError, match="each group needs >= 2 experts"):
        pdjax.configs.tiny(n_routed_experts=2, n_group=2, topk_group=1, num_experts_per_tok=1)
    assert pdjax.configs.tiny(n_routed_experts=1, n_group=1, topk_group=1, num_experts_per_tok=1).n_group == 1
