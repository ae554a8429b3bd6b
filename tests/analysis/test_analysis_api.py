"""Hardware registry, parameter counts, the report, and bad input."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax
from pdjax import analysis as A

from pdjax.analysis.hardware import FIGURES, hardware_names, unregister_hardware
from pdjax.analysis.report import Report, quickstart_section
from pdjax.analysis.units import GB, GiB, TB

CONTRACT_NAMES = ("h100-sxm", "h800", "h200", "h20", "b200", "a100", "mi300x", "gb200", "ascend-910c")


# ---- hardware presets and registry ---------------------------------------------------

@pytest.mark.parametrize("name", CONTRACT_NAMES)
def test_presets_have_sourced_figures(name):
    spec = A.hardware(name)
    assert isinstance(spec, A.HardwareSpec)
    for field in FIGURES:
        assert spec.source(field), f"{name}.{field} has no source note"
    for field in ("peak_bf16_flops", "hbm_bytes", "hbm_bw", "scale_up_bw", "scale_out_bw"):
        assert getattr(spec, field) > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hbm_bw = 1.0


def test_lookup_is_forgiving_about_spelling():
    assert A.hardware("H100 SXM") is A.hardware("h100-sxm") is A.hardware("h100")
    assert A.hardware("Ascend_910C") is A.hardware("910c")
    spec = A.hardware("h200")
    assert A.hardware(spec) is spec
    assert set(CONTRACT_NAMES) <= set(hardware_names())


def test_unknown_hardware():
    with pytest.raises(ValueError, match="unknown hardware 'tpu-v9'"):
        A.hardware("tpu-v9")


@pytest.mark.parametrize("name", ["a100", "ascend-910c"])
def test_missing_figure_names_hardware_and_field(name):
    assert A.hardware(name).peak_fp8_flops is None
    with pytest.raises(ValueError, match=rf"'{name}'.*peak_fp8_flops"):
        A.machine_balance(name, dtype="fp8")


def test_missing_link_figure():
    spec = A.HardwareSpec("lab-card", peak_bf16_flops=100e12, hbm_bytes=16 * GB, hbm_bw=1 * TB)
    assert A.machine_balance(spec) == pytest.approx(100)
    with pytest.raises(ValueError, match="'lab-card'.*scale_out_bw"):
        spec.link_bw("scale_out")
    report = A.report(pdjax.configs.tiny(), spec, verbose=False)
    assert report.handoff["link_bw_B_per_s"] is None
    assert report.roofline["machine_balance_fp8_flop_per_B"] is None


def test_register_custom_hardware():
    spec = A.HardwareSpec("my-npu", peak_bf16_flops=400e12, peak_fp8_flops=800e12,
                          hbm_bytes=64 * GB, hbm_bw=2 * TB, scale_up_bw=100 * GB,
                          scale_out_bw=25 * GB,
                          sources={"hbm_bw": "vendor sheet rev 2"})
    try:
        A.register_hardware(spec)
        assert A.hardware("My NPU") is spec
        assert A.hardware("my-npu").source("hbm_bw") == "vendor sheet rev 2"
        assert A.machine_balance("my-npu", "fp8") == pytest.approx(400)
        with pytest.raises(ValueError, match="already registered"):
            A.register_hardware(spec)
        faster = spec.replace(hbm_bw=4 * TB)
        A.register_hardware(faster, overwrite=True)
        assert A.machine_balance("my-npu") == pytest.approx(100)
    finally:
        unregister_hardware("my-npu")
    assert "my-npu" not in hardware_names()
    with pytest.raises(ValueError, match="preset"):
        unregister_hardware("h100")
    with pytest.raises(TypeError):
        A.register_hardware({"name": "dict"})


@pytest.mark.parametrize("field, value", [("hbm_bw", -1.0), ("peak_bf16_flops", 0),
                                          ("scale_out_bw", float("nan")), ("hbm_bytes", "80GB")])
def test_bad_hardware_figure(field, value):
    with pytest.raises(ValueError, match=f"'bad'.*{field}"):
        A.HardwareSpec("bad", **{field: value})


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown compute dtype 'int4'"):
        A.machine_balance("h100", dtype="int4")
    assert A.machine_balance("h100", "bfloat16") == A.machine_balance("h100", "bf16")


# ---- parameter counts ----------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "small", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3"])
def test_param_counts_match_the_model_tree(preset):
    cfg = pdjax.configs.preset(preset)
    shapes = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    n = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves({k: v for k, v in shapes.items()
                                                                          if k != "mtp"}))
    assert A.param_counts(cfg).total == n
    mtp = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(shapes.get("mtp", [])))
    assert A.param_counts(cfg).mtp == mtp and (mtp > 0) == (preset == "deepseek_v3")


@pytest.mark.parametrize("preset, total_b, active_b, decimals", [
    ("deepseek_v3", 671, 37, 0), ("deepseek_v2", 236, 21, 0)])
def test_param_counts_reproduce_published_totals(preset, total_b, active_b, decimals):
    counts = A.param_counts(pdjax.configs.preset(preset))
    assert round(counts.total / 1e9, decimals) == total_b
    assert round(counts.active / 1e9, decimals) == active_b
    # counting the input-embedding lookup as active breaks V3's 37B (37.55 -> 38)
    assert counts.active_with_embedding - counts.active == counts.embedding


def test_param_counts_v2_lite():
    counts = A.param_counts(pdjax.configs.deepseek_v2_lite())
    assert round(counts.total / 1e9, 1) == 15.7
    # 2.451e9: the model card's "2.4B" is truncated (2.45 rounds to 2.5); counting the
    # embedding too (2.66e9) or neither embedding nor head (2.24e9) is further away.
    assert int(counts.active / 1e8) / 10 == 2.4
    assert abs(counts.active / 1e9 - 2.4) < abs(counts.active_with_embedding / 1e9 - 2.4)
    assert abs(counts.active / 1e9 - 2.4) < abs((counts.active - counts.lm_head) / 1e9 - 2.4)


def test_mtp_module_count():
    v3 = A.param_counts(pdjax.configs.deepseek_v3(), mtp_layers=1)
    # DeepSeek: "685B = 671B main model + 14B MTP"; this count gives 684.5B / 13.5B.
    assert abs(v3.checkpoint_total / 1e9 - 685) < 1
    assert abs((v3.checkpoint_total - v3.total) / 1e9 - 14) < 1
    assert A.param_counts(pdjax.configs.deepseek_v3()).mtp == v3.mtp          # the config's one MTP depth
    assert A.param_counts(pdjax.configs.deepseek_v3(), mtp_layers=0).mtp == 0
    with pytest.raises(ValueError, match="mtp_layers"):
        A.param_counts(pdjax.configs.deepseek_v3(), mtp_layers=-1)


def test_ep_layouts():
    v3 = pdjax.configs.deepseek_v3()
    counts = A.param_counts(v3)
    even = A.ep_weight_bytes_per_gpu(v3, 144, 1, layout="even")
    replicated = A.ep_weight_bytes_per_gpu(v3, 144, 1, layout="replicated")
    assert even == pytest.approx(counts.total / 144)
    assert replicated == pytest.approx(counts.routed_experts / 144 + counts.non_routed)
    assert replicated > even
    assert A.ep_weight_bytes_per_gpu(v3, 1, 1, "replicated") == pytest.approx(counts.total)


# ---- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda c: A.kv_bytes_per_token(c, 2, "linear"), "unknown attention kind 'linear'"),
    (lambda c: A.kv_bytes_per_token(c, 2, "gqa"), "num_kv_groups"),
    (lambda c: A.kv_bytes_per_token(c, 2, "gqa", num_kv_groups=3), "num_kv_groups=3 must divide"),
    (lambda c: A.kv_bytes_per_token(c, 2, "mha", num_kv_groups=8), "only meaningful"),
    (lambda c: A.kv_bytes_per_token(c, -2, "mla"), "dtype_bytes"),
    (lambda c: A.concurrency_bound(-1, 4096, 70272, unit="GB"), "free_memory"),
    (lambda c: A.concurrency_bound(75, 4096, 70272, unit="gb"), "unknown size unit 'gb'"),
    (lambda c: A.concurrency_bound(75, 0, 70272, unit="GB"), "context_len"),
    (lambda c: A.concurrency_bound(75, 4096, -5, unit="GB"), "kv_bytes_per_token"),
    (lambda c: A.free_memory_bytes(80 * GB, 90 * GB), "do not fit"),
    (lambda c: A.free_memory_bytes(80 * GB, 4 * GB, act_bytes=-1), "act_bytes"),
    (lambda c: A.kv_handoff_time(32768, 70272, -50 * GB), "link_bw"),
    (lambda c: A.handoff_to_prefill_ratio(70272, 37e9, 989e12, 0), "link_bw"),
    (lambda c: A.kv.prefill_compute_time(4096, -1, 989e12), "active_params"),
    (lambda c: A.weight_intensity(-1), "batch_tokens"),
    (lambda c: A.ep_weight_bytes_per_gpu(c, 0), "ep_size"),
    (lambda c: A.ep_weight_bytes_per_gpu(c, 8, layout="striped"), "unknown EP layout"),
    (lambda c: A.moe_bounds.moe_mfu_bound(c.replace(n_routed_experts=0, first_k_dense_replace=0)), "no routed"),
    (lambda c: A.moe_bounds.tokens_per_expert(c, -3), "batch_tokens"),
    (lambda c: A.bubble_ratio_1f1b(0, 16), "num_stages"),
    (lambda c: A.bubble_ratio_1f1b(16, 2.5), "num_microbatches"),
    (lambda c: A.min_microbatches_1f1b(16, 1.5), "max_ratio"),
    (lambda c: A.afd_min_microbatches(2.0, 1.0), "cannot hide"),
    (lambda c: A.afd_min_microbatches(-1.0, 1.0), "comm_time"),
    (lambda c: A.afd_speedup(1.5, 1.15, 1.2), "attention_share"),
    (lambda c: A.afd_speedup(-1.5, 1.15, 0.8), "batch_gain"),
    (lambda c: A.afd_bounds.attention_share(0, 16), "num_attention"),
    (lambda c: A.decode_batch_for_context(808704, -2048), "context_len"),
    (lambda c: A.report(c, "h800", context_len=-1, verbose=False), "context_len"),
    (lambda c: A.report(c, "nonesuch", verbose=False), "unknown hardware"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(pdjax.configs.deepseek_v3())


# ---- properties ----------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.integers(1, 2048))
def test_bubble_ratio_properties(stages, m):
    rho = A.bubble_ratio_1f1b(stages, m)
    assert 0 <= rho < 1
    assert A.bubble_ratio_1f1b(stages, m + 1) <= rho


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 64), st.sampled_from([0.5, 0.25, 0.2, 0.1, 0.05, 0.01]))
def test_microbatches_for_bubble_is_minimal(stages, target):
    m = A.min_microbatches_1f1b(stages, target)
    assert A.bubble_ratio_1f1b(stages, m) < target
    assert m == 1 or A.bubble_ratio_1f1b(stages, m - 1) >= target - 1e-15


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
def test_kv_order_and_intensity_duality(groups):
    v3 = pdjax.configs.deepseek_v3()
    mha, mqa = A.kv_bytes_per_token(v3, 2, "mha"), A.kv_bytes_per_token(v3, 2, "mqa")
    gqa = A.kv_bytes_per_token(v3, 2, "gqa", num_kv_groups=groups)
    assert mqa <= gqa <= mha
    # same FLOPs for every kind: intensity is inversely proportional to KV bytes
    assert A.attention_intensity(v3, "gqa", 2, groups) * gqa == pytest.approx(
        A.attention_intensity(v3, "mha", 2) * mha)


# ---- report and quick-start section --------------------------------------------------

def test_report_returns_data_and_prints_only_when_asked(capsys):
    v3 = pdjax.configs.deepseek_v3()
    sheet = A.report(v3, "h800", context_len=4989, ep_size=144, weight_dtype_bytes=1,
                     num_kv_groups=8)
    assert capsys.readouterr().out == ""                  # a library call does not print
    A.report(v3, "h800", context_len=4989, ep_size=144, weight_dtype_bytes=1, num_kv_groups=8,
             verbose=True)
    printed = capsys.readouterr().out
    assert "machine_balance_bf16_flop_per_B" in printed and "c_max_mla" in printed
    assert printed.strip() == str(sheet).strip() and "c_max_mla" in sheet._repr_html_()
    d = sheet.as_dict()
    assert set(Report.SECTIONS) <= set(d)
    assert d["attention"]["mla_kv_per_token_B"] == 70272
    assert "gqa8_kv_per_token_B" in d["attention"]
    assert d["memory"]["free_GiB"] == pytest.approx(d["memory"]["free_GB"] * GB / GiB)
    assert round(d["memory"]["c_max_mla"]) == 215  # 75.34 GB free; floored to 75 as published -> 214
    assert d["pipeline"]["microbatches_for_bubble_below_0.1"] == 136
    assert str(sheet).count("\n") > 30


@pytest.mark.parametrize("layout", ["even", "replicated"])
def test_report_defaults_to_the_smallest_ep_at_which_the_weights_fit(layout):
    """report(cfg, hw) with its defaults gives a useful sheet: the EP size is the smallest
    divisor of the routed experts whose per-GPU weights (ep_weight_bytes_per_gpu) fit the HBM,
    so the weights fit, there is a concurrency, and the next smaller divisor does not fit."""
    v3, hbm = pdjax.configs.deepseek_v3(), A.hardware("h800").hbm_bytes
    m = A.report(v3, "h800", ep_layout=layout).memory
    ep = m["ep_size"]
    assert m["ep_size_chosen"] and m["weights_fit"] and m["c_max_mla"] > 1
    divisors = [d for d in range(1, v3.n_routed_experts + 1) if v3.n_routed_experts % d == 0]
    smaller = divisors[divisors.index(ep) - 1]
    assert A.ep_weight_bytes_per_gpu(v3, ep, 2, layout) < hbm <= A.ep_weight_bytes_per_gpu(v3, smaller, 2, layout)
    assert m["weights_per_gpu_GB"] * GB == pytest.approx(A.ep_weight_bytes_per_gpu(v3, ep, 2, layout))
    assert ep == 32     # bf16 V3 on 80 GB: even 1,342 GB / 32 = 41.9 GB (/ 16: 83.9); replicated
    #                     34.2 GB + 1,308 GB / 32 = 75.1 GB (/ 16: 116)
    pinned = A.report(v3, "h800", ep_size=ep, ep_layout=layout).memory
    assert pinned["ep_size_chosen"] is False and pinned["weights_per_gpu_GB"] == m["weights_per_gpu_GB"]
    # act_bytes stays free: with all but 30 GB reserved, even needs EP64 (21.0 GB); replicated
    # never fits (34.2 GB not routed): the largest EP, reported as not fitting
    tight = A.report(v3, "h800", ep_layout=layout, act_bytes=hbm - 30e9).memory
    assert (tight["ep_size"], tight["weights_fit"]) == ((64, True) if layout == "even" else (256, False))


def test_report_when_weights_do_not_fit():
    sheet = A.report(pdjax.configs.deepseek_v3(), "h100", ep_size=1, verbose=False)
    assert sheet.memory["weights_fit"] is False
    assert sheet.memory["c_max_mla"] == 0
    assert "do not fit" in quickstart_section(pdjax.configs.deepseek_v3(), "h100")


@pytest.mark.parametrize("preset", ["deepseek_v3", "tiny"])
@pytest.mark.parametrize("layout", ["even", "replicated"])
def test_weights_per_gpu_hold_at_least_one_routed_expert_per_moe_layer(preset, layout):
    """An EP rank holds at least one routed expert of every MoE layer, so the weights per GPU
    are at least one expert's bytes (gate, up and down projections) times the MoE layers
    (DeepSeek-V3 bf16: about 5.1 GB); an ep_size above the routed experts is refused."""
    cfg = pdjax.configs.preset(preset)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    p_w = 2
    floor = 3 * cfg.hidden_size * cfg.moe_intermediate_size * p_w * moe_layers
    E = cfg.n_routed_experts
    for ep in sorted({1, 2, E // 2, E - 1, E} - {0}):
        sheet = A.report(cfg, "h800", ep_size=ep, ep_layout=layout, weight_dtype_bytes=p_w, verbose=False)
        assert sheet.memory["weights_per_gpu_GB"] * GB >= floor * (1 - 1e-12), (ep, sheet.memory)
        assert A.ep_weight_bytes_per_gpu(cfg, ep, p_w, layout) >= floor * (1 - 1e-12)
    for ep in (E + 1, 1000):
        with pytest.raises(ValueError, match=f"ep_size: must not exceed .*n_routed_experts = {E}.*got {ep}"):
            A.report(cfg, "h800", ep_size=ep, ep_layout=layout, weight_dtype_bytes=p_w, verbose=False)
        with pytest.raises(ValueError, match=f"ep_size: .*got {ep}"):
            A.ep_weight_bytes_per_gpu(cfg, ep, p_w, layout)
    if preset == "deepseek_v3":
        assert 5.0e9 < floor < 5.2e9


def test_quickstart_section():
    text = quickstart_section(pdjax.configs.deepseek_v3(), "h800", context_len=4989,
                                ep_size=144, weight_dtype_bytes=1)
    assert "70,272 B (68.6 KiB)" in text and "3,997,696 B (3.81 MiB)" in text
    assert "56.9x" in text and "295 FLOP/B" in text and "C_max" in text
    tiny = quickstart_section(pdjax.configs.tiny(), "a100")
    assert tiny.startswith("### ") and "MLA" in tiny and "MHA" in tiny


def test_kv_defaults_and_the_zero_free_memory_boundary():
    """The KV formulas default to 2-byte (bf16) values and no activation reserve; memory that
    the weights and activations fill exactly leaves nothing for KV: an error, as over-full
    memory is (boundaries found unpinned by mutation testing)."""
    from pdjax.analysis import kv

    cfg = pdjax.configs.deepseek_v3()
    assert kv.kv_bytes_per_token(cfg) == kv.kv_bytes_per_token(cfg, 2) == 2 * cfg.num_hidden_layers * \
        (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert kv.kv_bytes_per_sequence(cfg, 100) == 100 * kv.kv_bytes_per_token(cfg, 2)
    assert kv.free_memory_bytes(100.0, 40.0) == kv.free_memory_bytes(100.0, 40.0, 0.0) == 60.0
    with pytest.raises(ValueError, match="do not fit"):
        kv.free_memory_bytes(100.0, 60.0, 40.0)
    assert kv.free_memory_bytes(100.0, 60.0, 39.0) == 1.0


def test_kv_heads_per_attention_kind_and_the_mla_default():
    """kv_heads caches n_h K/V heads per layer for MHA, num_kv_groups for GQA, one for MQA and
    none for MLA (a shared latent instead: 0, as documented); kv_elements_per_token without an
    attention kind is MLA's (d_c + d_R) * L (both found unpinned by mutation testing)."""
    from pdjax.analysis import kv

    cfg = pdjax.configs.deepseek_v3()
    h = cfg.num_attention_heads
    assert [kv.kv_heads(cfg, k) for k in ("mha", "mqa", "mla")] == [h, 1, 0]
    assert kv.kv_heads(cfg, "gqa", num_kv_groups=8) == 8
    assert kv.kv_elements_per_token(cfg) == kv.kv_elements_per_token(cfg, "mla") == \
        (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers


def test_report_counts_the_mtp_modules_only_when_speculative_decoding_serves_them():
    """speculative="mtp": each GPU also holds the MTP module (its routed experts split over
    the EP ranks like any MoE layer's, the rest whole) and its layer's latent KV."""
    from pdjax.analysis.units import GB

    v3 = pdjax.configs.deepseek_v3()
    counts = A.param_counts(v3)
    routed = v3.n_routed_experts * 3 * v3.hidden_size * v3.moe_intermediate_size
    # bytes at fp8: "even" splits the whole model over EP, "replicated" only the routed experts
    for layout, held in (("even", counts.mtp / 32), ("replicated", (counts.mtp - routed) + routed / 32)):
        plain = A.report(v3, "h800", ep_size=32, weight_dtype_bytes=1, ep_layout=layout)
        spec = A.report(v3, "h800", ep_size=32, weight_dtype_bytes=1, ep_layout=layout, speculative="mtp")
        assert plain.params["mtp"] == 0 and spec.params["mtp"] == counts.mtp
        delta = (spec.memory["weights_per_gpu_GB"] - plain.memory["weights_per_gpu_GB"]) * GB
        assert delta == pytest.approx(held, rel=1e-9), layout
    assert spec.memory["mla_kv_per_sequence_GB"] / plain.memory["mla_kv_per_sequence_GB"] == pytest.approx(62 / 61)
    with pytest.raises(ValueError, match="speculative='mtp' needs a config with MTP modules"):
        A.report(pdjax.configs.deepseek_v2(), "h800", speculative="mtp")
    with pytest.raises(ValueError, match="speculative must be None or 'mtp'"):
        A.report(v3, "h800", speculative="eagle")
