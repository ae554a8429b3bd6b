import pytest

import pdjax
from pdjax.config import from_hf_dict


@pytest.mark.parametrize("name", sorted(pdjax.configs.PRESETS))
def test_presets_are_valid_and_hashable(name):
    cfg = pdjax.configs.preset(name)
    assert hash(cfg) == hash(pdjax.configs.preset(name))
    assert cfg.kv_latent_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim


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
    assert sum(v for k, v in rows.items() if k not in ("total", "active per token")) == rows["total"]
    page = cfg._repr_html_()
    for value in (counts.total, counts.active, counts.routed_experts):
        assert f"{value:,}" in page
    assert "kv_lora_rank" in page and "active per token" in page
