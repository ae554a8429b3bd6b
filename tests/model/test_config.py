import pytest

import pdjax
from pdjax.model_config import from_hf_dict


@pytest.mark.parametrize("name", sorted(pdjax.configs.PRESETS))
def test_presets_are_valid_and_hashable(name):
    cfg = pdjax.configs.preset(name)
    assert hash(cfg) == hash(pdjax.configs.preset(name))
    assert cfg.mla_latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cfg.kv_latent_dim == cfg.mla_latent_dim + cfg.index_head_dim       # the indexer's key with DSA
    assert cfg.sparse_attention == name.endswith("v32")


@pytest.mark.parametrize("changes, field", [
    (dict(n_routed_experts=10, n_group=4), "n_group"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(kv_lora_rank=-3), "kv_lora_rank"),
    (dict(topk_group=5), "topk_group"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(topk_method="best"), "topk_method"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(model_type="llama"), "model_type"),
])
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        pdjax.configs.tiny(**changes)


def test_hf_dict_rope_forms_agree():
    base = pdjax.configs.deepseek_v3().to_hf_dict()
    legacy = from_hf_dict(base)
    new = dict(base)
    rs = new.pop("rope_scaling")
    new["rope_parameters"] = dict(rs, rope_type="yarn", rope_theta=new.pop("rope_theta"))
    assert from_hf_dict(new) == legacy == pdjax.configs.deepseek_v3()


def test_softmax_scale_uses_mscale_all_dim():
    import math
    cfg = pdjax.configs.deepseek_v3()
    m = 0.1 * cfg.rope_scaling.mscale_all_dim * math.log(cfg.rope_scaling.factor) + 1
    assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m)


def test_config_displays_its_parameter_counts():
    """A notebook shows a config with its total, active and per-component parameter counts;
    the components add up to the total."""
    from pdjax.analysis import param_counts

    cfg = pdjax.configs.deepseek_v3()
    counts = param_counts(cfg)
    rows = dict(counts.table())
    assert sum(v for k, v in rows.items() if k not in ("total", "mtp (apart)", "active per token")) == rows["total"]
    assert rows["mtp (apart)"] == counts.mtp > 0                        # V3's MTP module, not in the 671B
    page = cfg._repr_html_()
    for value in (counts.total, counts.active, counts.routed_experts):
        assert f"{value:,}" in page
    assert "kv_lora_rank" in page and "active per token" in page


NAN, INF = float("nan"), float("inf")
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("changes, field, kind", [
    ({"rms_norm_eps": NAN}, "rms_norm_eps", ValueError),
    ({"routed_scaling_factor": INF}, "routed_scaling_factor", ValueError),
    ({"rope_theta": NAN}, "rope_theta", ValueError),
    ({"rope_theta": "10000"}, "rope_theta", TypeError),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor", ValueError),
    ({"norm_topk_prob": "false"}, "norm_topk_prob", TypeError),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings", TypeError),
    ({"n_routed_experts": 8.0}, "n_routed_experts", TypeError),
    ({"n_shared_experts": 1.5}, "n_shared_experts", TypeError),
    ({"hidden_size": "64"}, "hidden_size", TypeError),
    ({"num_hidden_layers": True}, "num_hidden_layers", TypeError),
    ({"q_lora_rank": 32.0}, "q_lora_rank", TypeError),
    ({"scoring_func": 1}, "scoring_func", TypeError),
    ({"rope_scaling": {**YARN, "factor": NAN}}, "rope_scaling.factor", ValueError),
    ({"rope_scaling": {**YARN, "mscale_all_dim": INF}}, "rope_scaling.mscale_all_dim", ValueError),
    ({"rope_scaling": {**YARN, "factor": None}}, "rope_scaling.factor", ValueError),
    ({"rope_scaling": {**YARN, "factor": "40"}}, "rope_scaling.factor", TypeError),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": 4096.0}},
     "rope_scaling.original_max_position_embeddings", TypeError),
    ({"rope_scaling": {k if k != "factor" else "factr": v for k, v in YARN.items()}}, "factr", ValueError),
    ({"rope_scaling": {**YARN, "truncate": False}}, "rope_scaling.truncate", ValueError),
])
def test_config_values_are_typed_never_coerced(changes, field, kind):
    """NaN, inf, strings, floats for counts, "false" for a bool, a typo or a null in
    rope_scaling: each refused on construction (a TypeError or ValueError of the kind named)
    naming the field; the same from a config.json dict, as a ValueError."""
    with pytest.raises(kind, match=field.replace(".", r"\.")):
        pdjax.configs.tiny(**changes)
    hf = {**pdjax.configs.tiny().to_hf_dict(), **changes}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        from_hf_dict(hf)


def test_numpy_scalars_are_numbers_and_stored_as_python_values():
    import numpy as np

    cfg = pdjax.configs.tiny(hidden_size=np.int64(64), rms_norm_eps=np.float32(1e-6), norm_topk_prob=np.bool_(True))
    assert type(cfg.hidden_size) is int and type(cfg.rms_norm_eps) is float and cfg.norm_topk_prob is True
    assert cfg == pdjax.configs.tiny(rms_norm_eps=float(np.float32(1e-6)), norm_topk_prob=True)
    assert hash(cfg) == hash(pdjax.configs.tiny(rms_norm_eps=float(np.float32(1e-6)), norm_topk_prob=True))
    rs = pdjax.configs.tiny(rope_scaling={**YARN, "truncate": True}).rope_scaling
    assert rs.factor == 40.0 and rs.original_max_position_embeddings == 4096
