"""The cost model: roofline op costs, the fitted prefill cost and its inverse, calibration.

Reference figures (the source articles' worked results, see docs/analysis.md) are
recomputed from configs and presets (never typed in as inputs); a literal is only the
published rounded result, compared at the precision it is printed.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pdjax
from pdjax import analysis as A
from pdjax import timing
from pdjax.analysis.costmodel_fit import fit_decode_cost, fit_prefill_cost
from pdjax.analysis.units import GB


@pytest.fixture(scope="module")
def v3():
    return pdjax.configs.deepseek_v3()


@pytest.fixture(scope="module")
def v3_h800(v3):
    return A.RooflineCostModel(v3, A.hardware("h800"))


# ---- roofline cost model -------------------------------------------------------------------

def test_kv_transfer_reproduces_brief(v3_h800, v3):
    """32,768 tokens of DeepSeek-V3 MLA KV at 50 GB/s: 46.0 ms; at 160 GB/s: 14.4 ms."""
    assert v3_h800.kv_bytes_per_token() == A.kv_bytes_per_token(v3, dtype_bytes=2)
    t50 = v3_h800.kv_transfer_time(32768, 50 * GB)
    assert t50 == pytest.approx(A.kv_handoff_time(32768, A.kv_bytes_per_token(v3), 50 * GB))
    # 46.05 ms: the source article prints 46.0 (truncated), as in test_analysis_brief
    assert math.floor(t50 * 1e4) / 10 == 46.0 and abs(t50 * 1e3 - 46.0) < 0.1
    assert round(v3_h800.kv_transfer_time(32768, 160 * GB) * 1e3, 1) == 14.4
    # the source articles' 50 GB/s link is the H800's scale-out (IB) figure
    assert v3_h800.kv_transfer_time(32768, A.hardware("h800").scale_out_bw) == t50
    assert v3_h800.kv_transfer_time(0, 50 * GB) == 0.0
    slow = A.RooflineCostModel(v3, "h800", efficiency=A.Efficiency(network=0.5))
    assert slow.kv_transfer_time(32768, 50 * GB) == pytest.approx(2 * t50)


def test_decode_b1_is_weight_bandwidth_bound(v3_h800, v3):
    """One decode token reads every active weight once: step time = N_a * p / HBM bw (plus
    the one-token KV read and the activations, < 0.1 %), and every op is memory-bound."""
    counts = A.param_counts(v3)
    assert v3_h800.touched_weight_bytes(1) == pytest.approx(counts.active * 2, rel=1e-12)
    ideal = counts.active * 2 / v3_h800.hbm_bw
    assert v3_h800.decode_step_time([0]) == pytest.approx(ideal, rel=1e-3)
    assert v3_h800.decode_step_time([0]) >= ideal
    assert all(op.bound == "memory" for op in v3_h800.op_costs(kv_lens=[0]).values())


def test_decode_needs_about_balance_batch_to_leave_memory_bound(v3):
    """Dense weight GEMMs turn compute-bound near B = A* (295 on H800 bf16): the dense MLP
    op is memory-bound at B = A*/2 and compute-bound at 2 A*."""
    model = A.RooflineCostModel(v3, "h800")
    a_star = A.roofline.compute_bound_batch("h800")
    lo = model.op_costs(kv_lens=[1] * int(a_star / 2))["dense_mlp"]
    hi = model.op_costs(kv_lens=[1] * int(2 * a_star))["dense_mlp"]
    assert lo.bound == "memory" and hi.bound == "compute"


def test_prefill_large_q_is_compute_bound(v3_h800, v3):
    """A 32,768-token prefill is compute-bound in every layer op, and at least the weight
    FLOPs 2 N_a S / R_peak of the source articles (attention's S^2 work comes on top)."""
    ops = v3_h800.op_costs(chunks=[(32768, 0)])
    for name in ("attention", "dense_mlp", "moe_experts"):
        assert ops[name].bound == "compute", name
    t = v3_h800.prefill_step_time([(32768, 0)])
    counts = A.param_counts(v3)
    assert t >= A.kv.prefill_compute_time(32768, counts.active, v3_h800.peak_flops)
    # the handoff is then a small fraction of the prefill, as in the source articles (~1.9 %
    # of the weight FLOPs alone)
    assert v3_h800.kv_transfer_time(32768, 50 * GB) / t < A.handoff_to_prefill_ratio(
        A.kv_bytes_per_token(v3), counts.active, v3_h800.peak_flops, 50 * GB)


def test_expected_distinct_experts():
    assert A.costmodel.expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert A.costmodel.expected_distinct_experts(256, 8, 0) == 0
    assert A.costmodel.expected_distinct_experts(256, 8, 10**5) == pytest.approx(256)
    vals = [A.costmodel.expected_distinct_experts(16, 2, t) for t in range(1, 50)]
    assert all(b > a for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="top_k"):
        A.costmodel.expected_distinct_experts(4, 8, 1)


def test_prefill_cost_grows_with_q_and_c(v3_h800):
    base = v3_h800.prefill_step_time([(1024, 0)])
    assert v3_h800.prefill_step_time([(2048, 0)]) > base
    assert v3_h800.prefill_step_time([(1024, 4096)]) > base
    both = v3_h800.prefill_step_time([(1024, 0), (1024, 4096)])
    assert both < base + v3_h800.prefill_step_time([(1024, 4096)])   # weights read once
    assert v3_h800.prefill_step_time([]) == 0.0 and v3_h800.decode_step_time([]) == 0.0


def test_decode_cost_grows_with_kv(v3_h800):
    assert v3_h800.decode_step_time([8192] * 64) > v3_h800.decode_step_time([1024] * 64)
    ops = v3_h800.op_costs(kv_lens=[4096] * 32)
    assert set(ops) == {"attention", "dense_mlp", "moe_experts", "lm_head"}
    assert sum(op.total_s for op in ops.values()) == pytest.approx(
        v3_h800.decode_step_time([4096] * 32))
    row = ops["attention"].as_dict()
    assert row["layers"] == 61 and row["bound"] in ("compute", "memory")


def test_afd_split_sums_to_decode_step(v3):
    """The AF split (used by the simulator's AF-disaggregated deployment) partitions the
    decode step: attention side + FFN side = the whole step."""
    model = A.RooflineCostModel(v3, "h800", ep_size=16,
                                efficiency=A.Efficiency(step_overhead_s=1e-4))
    kv_lens = [4096] * 48 + [100] * 16
    assert model.decode_attention_time(kv_lens) + model.decode_ffn_time(len(kv_lens)) == (
        pytest.approx(model.decode_step_time(kv_lens)))
    assert model.decode_ffn_time(0) == 0.0 and model.decode_attention_time([]) == 0.0
    assert model.decode_attention_time([8192] * 64) > model.decode_attention_time([1024] * 64)


def test_efficiency_and_overhead_scale(v3):
    ideal = A.RooflineCostModel(v3, "h800")
    slow = A.RooflineCostModel(v3, "h800", efficiency=A.Efficiency(
        matmul=0.5, attention=0.5, hbm=0.5, network=0.5, step_overhead_s=1e-3))
    for chunks in ([(4096, 0)], [(256, 8192)]):
        assert slow.prefill_step_time(chunks) == pytest.approx(
            2 * ideal.prefill_step_time(chunks) + 1e-3)
    with pytest.raises(ValueError, match="matmul"):
        A.Efficiency(matmul=1.5)
    with pytest.raises(ValueError, match="step_overhead_s"):
        A.Efficiency(step_overhead_s=-1)


def test_expert_parallel_adds_all_to_all(v3):
    ep1 = A.RooflineCostModel(v3, "h800")
    ep32 = A.RooflineCostModel(v3, "h800", ep_size=32)
    chunks = [(4096, 0)] * 32
    ops = ep32.op_costs(chunks=chunks)
    assert "all_to_all" in ops and ops["all_to_all"].bound == "network"
    assert "all_to_all" not in ep1.op_costs(chunks=chunks)
    # all-to-all bytes per GPU: its T/ep tokens x k copies x D x p, dispatch + combine,
    # the remote (ep-1)/ep of them, over the scale-out link beyond one node
    T = 32 * 4096
    expected = 2 * (T / 32) * v3.num_experts_per_tok * v3.hidden_size * 2 * 31 / 32
    assert ops["all_to_all"].link_bytes == pytest.approx(expected)
    assert ops["all_to_all"].network_s == pytest.approx(expected / A.hardware("h800").scale_out_bw)
    # compute splits over the 32 GPUs
    assert ops["moe_experts"].flops == pytest.approx(ep1.op_costs(chunks=chunks)["moe_experts"].flops / 32)
    assert A.RooflineCostModel(v3, "h800", ep_size=8).op_costs(chunks=chunks)["all_to_all"].network_s == (
        pytest.approx(2 * (T / 8) * v3.num_experts_per_tok * v3.hidden_size * 2 * 7 / 8
                      / A.hardware("h800").scale_up_bw))


def test_fp8_uses_fp8_peak_and_halves_bytes(v3):
    bf16 = A.RooflineCostModel(v3, "h800")
    fp8 = A.RooflineCostModel(v3, "h800", dtype_bytes=1)
    assert fp8.peak_flops == A.hardware("h800").peak_fp8_flops
    assert fp8.kv_bytes_per_token() * 2 == bf16.kv_bytes_per_token()
    # everything halves but the fp32 logits the head writes
    assert fp8.decode_step_time([0]) == pytest.approx(bf16.decode_step_time([0]) / 2, rel=1e-4)
    with pytest.raises(ValueError, match="fp8"):
        A.RooflineCostModel(v3, "a100", dtype_bytes=1)   # no FP8 figure on A100


def test_dense_model_has_no_moe_ops():
    cfg = pdjax.configs.tiny(n_routed_experts=0, n_shared_experts=0)
    ops = A.RooflineCostModel(cfg, "h100").op_costs(chunks=[(64, 0)])
    assert set(ops) == {"attention", "dense_mlp", "lm_head"}


@pytest.mark.parametrize("bad, match", [
    (dict(chunks=[(0, 0)]), "q"), (dict(chunks=[(4, -1)]), "c"), (dict(chunks=[(4,)]), "pair"),
    (dict(chunks=[(2.5, 0)]), "q"), (dict(kv_lens=[-1]), "kv_lens"), (dict(), "exactly one"),
    (dict(chunks=[(1, 0)], kv_lens=[1]), "exactly one"), (dict(chunks="ab"), "chunks")])
def test_op_costs_bad_input(v3_h800, bad, match):
    with pytest.raises(ValueError, match=match):
        v3_h800.op_costs(**bad)


def test_constructor_bad_input(v3):
    with pytest.raises(ValueError, match="dtype_bytes"):
        A.RooflineCostModel(v3, "h800", dtype_bytes=4)
    with pytest.raises(ValueError, match="ep_size"):
        A.RooflineCostModel(v3, "h800", ep_size=0)
    with pytest.raises(ValueError, match="a2a_link"):
        A.RooflineCostModel(v3, "h800", a2a_link="pcie")
    with pytest.raises(ValueError, match="unknown hardware"):
        A.RooflineCostModel(v3, "tpu-v9")
    with pytest.raises(TypeError):
        A.RooflineCostModel("v3", "h800")
    with pytest.raises(ValueError, match="link_bw"):
        A.RooflineCostModel(v3, "h800").kv_transfer_time(10, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        A.RooflineCostModel(v3, "h800").kv_transfer_time(-1, 1e9)
    no_net = A.HardwareSpec("no-net", peak_bf16_flops=1e15, hbm_bw=1e12)
    with pytest.raises(ValueError, match="scale_up_bw"):
        A.RooflineCostModel(v3, no_net, ep_size=4).prefill_step_time([(16, 0)])


# ---- fitted prefill cost ------------------------------------------------------------------

GRID = [(q, c) for q in (32, 64, 128, 256, 512) for c in (0, 256, 1024, 4096)]


def synthetic(a, b, g, d=0.0, shapes=GRID):
    return [(q, c, a * q * q + b * q * c + g * q + d) for q, c in shapes]


def test_fit_recovers_noise_free_coefficients():
    a, b, g = 3.1e-9, 7.7e-10, 2.4e-5
    fit = fit_prefill_cost(synthetic(a, b, g))
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    assert fit.g == pytest.approx(g, rel=1e-9) and fit.d == 0.0
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.n == len(GRID)
    assert fit(100, 50) == pytest.approx(a * 1e4 + b * 5000 + g * 100, rel=1e-9)
    with_d = fit_prefill_cost(synthetic(a, b, g, 0.02), intercept=True)
    assert (with_d.a, with_d.b, with_d.g, with_d.d) == pytest.approx((a, b, g, 0.02), rel=1e-9)


def test_fit_minimum_exact_samples():
    samples = synthetic(2e-9, 1e-9, 1e-5, shapes=[(64, 0), (128, 512), (512, 128)])
    fit = fit_prefill_cost(samples)
    assert (fit.a, fit.b, fit.g) == pytest.approx((2e-9, 1e-9, 1e-5), rel=1e-9)


def test_fit_is_non_negative():
    """A sample set whose unconstrained fit has a negative q^2 term (cost concave in q):
    NNLS pins that coefficient at 0, keeps the cost monotone, and loses a little R^2."""
    samples = [(q, 0, 1e-3 * math.sqrt(q)) for q in (16, 64, 256, 1024)] + [(64, 512, 0.02)]
    X = np.array([[q * q, q * c, q] for q, c, _ in samples], float)
    free, *_ = np.linalg.lstsq(X, np.array([s[2] for s in samples]), rcond=None)
    assert free.min() < 0
    fit = fit_prefill_cost(samples)
    assert min(fit.a, fit.b, fit.g) >= 0 and fit.r2 < 1
    qs = np.arange(1, 2000)
    assert np.all(np.diff(fit(qs, 100)) >= 0)


def test_fit_with_noise_has_high_r2():
    rng = np.random.default_rng(0)
    clean = synthetic(3e-9, 8e-10, 2e-5)
    noisy = [(q, c, t * (1 + 0.02 * rng.standard_normal())) for q, c, t in clean]
    fit = fit_prefill_cost(noisy)
    assert fit.r2 > 0.99
    errors = [abs(fit(q, c) - t) / t for q, c, t in clean]
    assert np.median(errors) < 0.05


@pytest.mark.parametrize("samples, kwargs, match", [
    ([(1, 0, 1.0), (2, 0, 2.0)], {}, "at least 3"),
    ([(1, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0)], dict(intercept=True), "at least 4"),
    ([(1, 0, 1.0), (2, 0, float("nan")), (3, 0, 3.0)], {}, "finite"),
    ([(1, 0, 1.0), (2, 0, float("inf")), (3, 0, 3.0)], {}, "finite"),
    ([(-1, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0)], {}, "q"),
    ([(1, -5, 1.0), (2, 0, 2.0), (3, 0, 3.0)], {}, "c"),
    ([(1, 0), (2, 0), (3, 0)], {}, "triples"),
    ([(0, 0, 1.0), (0, 5, 2.0), (0, 6, 3.0)], {}, "q > 0"),
])
def test_fit_bad_input(samples, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_prefill_cost(samples, **kwargs)


# ---- max_chunk: the time-budget chunk size -------------------------------------------------

coef = st.floats(min_value=1e-12, max_value=1e-6)


@settings(max_examples=300, deadline=None)
@given(a=coef, b=st.one_of(st.just(0.0), coef), g=st.floats(min_value=1e-9, max_value=1e-3),
       d=st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=1e-2)),
       c=st.integers(0, 200_000), budget=st.floats(min_value=1e-4, max_value=10.0))
def test_max_chunk_brackets_budget(a, b, g, d, c, budget):
    fit = A.costmodel_fit.PrefillCostFit(a=a, b=b, g=g, r2=1.0, n=3, d=d)
    q = fit.max_chunk(c, budget)
    assert q >= 0
    if q > 0:
        assert fit(q, c) <= budget
    else:
        assert fit(1, c) > budget
    assert fit(q + 1, c) > budget


@settings(max_examples=200, deadline=None)
@given(a=coef, g=st.floats(min_value=1e-9, max_value=1e-3), c=st.integers(0, 50_000),
       budget=st.floats(min_value=1e-4, max_value=5.0), align=st.sampled_from([1, 8, 128, 256]),
       q_max=st.one_of(st.none(), st.integers(1, 20_000)))
def test_max_chunk_alignment_and_cap(a, g, c, budget, align, q_max):
    fit = A.costmodel_fit.PrefillCostFit(a=a, b=1e-10, g=g, r2=1.0, n=3)
    q = fit.max_chunk(c, budget, q_max=q_max, align=align)
    free = fit.max_chunk(c, budget)
    assert q % align == 0 and q <= free
    if q_max is not None:
        assert q <= q_max
    cap = free if q_max is None else min(free, q_max)
    assert q == (cap // align) * align           # the largest aligned chunk that fits
    assume(q > 0)
    assert fit(q, c) <= budget


def test_max_chunk_examples():
    fit = A.costmodel_fit.PrefillCostFit(a=1e-8, b=1e-9, g=1e-5, r2=1.0, n=3)
    q = fit.max_chunk(4096, 0.05)
    assert fit(q, 4096) <= 0.05 < fit(q + 1, 4096)
    assert fit.max_chunk(4096, 0.05, align=256) == (q // 256) * 256
    assert fit.max_chunk(4096, 0.05, q_max=100) == 100
    assert fit.max_chunk(10**9, 1e-6) == 0                       # not even one token fits
    assert fit.max_chunk(0, fit(300, 0), align=256) == 256
    assert fit.max_chunk(0, fit(200, 0), align=256) == 0         # fewer than one tile fits
    const = A.costmodel_fit.PrefillCostFit(a=0.0, b=0.0, g=0.0, r2=1.0, n=3, d=0.01)
    assert const.max_chunk(0, 1.0, q_max=512) == 512
    assert const.max_chunk(0, 0.001, q_max=512) == 0
    with pytest.raises(ValueError, match="q_max"):
        const.max_chunk(0, 1.0)
    for kwargs, match in [(dict(c=-1, budget_s=1.0), "c"), (dict(c=0, budget_s=0), "budget_s"),
                          (dict(c=0, budget_s=-1.0), "budget_s"),
                          (dict(c=0, budget_s=1.0, align=0), "align"),
                          (dict(c=0, budget_s=1.0, q_max=0), "q_max")]:
        with pytest.raises(ValueError, match=match):
            fit.max_chunk(**kwargs)


def test_fit_of_roofline_model_matches_it(v3_h800, v3):
    """Where every op is compute-bound (long prefills of DeepSeek-V3), the roofline model's
    prefill times have the fitted form: R^2 ~ 1, b = FLOPs per (query, key) pair over all
    layers / peak, and the fitted inverse picks chunks that fill the roofline's budget.
    (At short q the memory-bound MoE weight read is a constant the three-term form lacks.)"""
    shapes = [(q, c) for q in (8192, 16384, 32768) for c in (0, 16384, 65536)]
    samples = [(q, c, v3_h800.prefill_step_time([(q, c)])) for q, c in shapes]
    fit = fit_prefill_cost(samples)
    assert fit.r2 > 0.999
    pair_flops = (A.roofline.attention_flops_per_token(v3, 1) + 2 * v3.num_attention_heads
                  * v3.qk_rope_head_dim) * v3.num_hidden_layers
    assert fit.b == pytest.approx(pair_flops / v3_h800.peak_flops, rel=0.03)
    q = fit.max_chunk(16384, 2.0, align=128)
    assert q % 128 == 0 and v3_h800.prefill_step_time([(q, 16384)]) == pytest.approx(2.0, rel=0.05)


# ---- calibration against the real prefill -------------------------------------------------

def test_calibrate_tiny_real_prefill(tiny_cfg, tiny_params):
    """A small real calibration on configs.tiny(): the fit explains the measurements
    (R^2 > 0.9). Not a timing assertion on absolute speed."""
    # calls of ~10-150 ms: far above the timer, and the q^2 growth dominates the noise of a
    # shared machine (a 5 ms call can take 15 ms under load)
    shapes = [(256, 0), (512, 0), (1024, 0), (512, 512)]
    result = timing.calibrate(tiny_params, tiny_cfg, shapes, repeats=5, holdout=[(256, 256)])
    assert result.fit.r2 > 0.9, result.table()
    assert [s[:2] for s in result.samples] == shapes and len(result.holdout) == 1
    assert all(t > 0 for _, _, t in result.samples + result.holdout)
    assert all(len(v) == 5 for v in result.repeats.values())
    assert np.isfinite(result.median_error) and result.max_error >= result.median_error
    rows = result.rows()
    assert len(rows) == 5 and rows[-1]["split"] == "held-out"
    assert "held-out relative error" in result.table()
    refit = result.refit(intercept=True, statistic="min")
    assert refit.fit.n == 4 and refit.statistic == "min"
    assert refit.samples[0][2] == min(result.repeats[shapes[0]])


def test_calibrate_bad_input(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="at least 3"):
        timing.calibrate(tiny_params, tiny_cfg, [(8, 0), (16, 0)])
    with pytest.raises(ValueError, match="overlap"):
        timing.calibrate(tiny_params, tiny_cfg, [(8, 0), (16, 0), (32, 0)], holdout=[(8, 0)])
    with pytest.raises(ValueError, match="q >= 1"):
        timing.calibrate(tiny_params, tiny_cfg, [(0, 0), (16, 0), (32, 0)])
    with pytest.raises(ValueError, match="integer"):
        timing.calibrate(tiny_params, tiny_cfg, [(8.5, 0), (16, 0), (32, 0)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        timing.calibrate(tiny_params, tiny_cfg, [(8, 0), (16, 0), (32, 2000)])
    with pytest.raises(ValueError, match="statistic"):
        timing.calibrate(tiny_params, tiny_cfg, [(8, 0), (16, 0), (32, 0)], statistic="mean")
    with pytest.raises(ValueError, match="repeats"):
        timing.measure_prefill(tiny_params, tiny_cfg, [(8, 0)], repeats=0)


# ---- fitted decode step cost t(B, K) = d0 + d1 B + d2 K ------------------------------------

DECODE_GRID = [(B, B * L) for B in (1, 4, 16, 64) for L in (64, 512, 4096)]


def synthetic_decode(d0, d1, d2, shapes=DECODE_GRID):
    return [(B, K, d0 + d1 * B + d2 * K) for B, K in shapes]


def test_fit_decode_recovers_noise_free_coefficients():
    d0, d1, d2 = 0.021, 3.7e-4, 1.3e-7
    fit = fit_decode_cost(synthetic_decode(d0, d1, d2))
    assert (fit.d0, fit.d1, fit.d2) == pytest.approx((d0, d1, d2), rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12) and fit.n == len(DECODE_GRID)
    assert fit(8, 8000) == pytest.approx(d0 + 8 * d1 + 8000 * d2, rel=1e-12)
    Bs, Ks = np.array([1, 2, 3]), np.array([10, 200, 3000])
    assert np.allclose(fit(Bs, Ks), d0 + d1 * Bs + d2 * Ks)
    assert fit.as_dict()["d2"] == fit.d2 and "R^2" in str(fit)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fit.d0 = 1.0
    # exactly three independent samples determine it
    three = fit_decode_cost(synthetic_decode(d0, d1, d2, [(1, 64), (8, 64), (8, 8192)]))
    assert (three.d0, three.d1, three.d2) == pytest.approx((d0, d1, d2), rel=1e-9)


def test_fit_decode_is_non_negative_and_tolerates_noise():
    # a time that falls with B: NNLS pins d1 at 0 instead of going negative
    falling = [(1, 100, 0.05), (2, 100, 0.04), (4, 100, 0.03), (4, 4000, 0.04)]
    fit = fit_decode_cost(falling)
    assert min(fit.d0, fit.d1, fit.d2) >= 0 and fit.d1 == 0 and fit.r2 < 1
    rng = np.random.default_rng(1)
    clean = synthetic_decode(0.02, 1e-3, 1.3e-6)
    noisy = [(B, K, t * (1 + 0.02 * rng.standard_normal())) for B, K, t in clean]
    fit = fit_decode_cost(noisy)
    assert fit.r2 > 0.99
    assert np.median([abs(fit(B, K) - t) / t for B, K, t in clean]) < 0.05
    errs = A.costmodel_fit.relative_errors(fit, clean)
    assert errs.shape == (len(clean),) and np.median(errs) < 0.05


@pytest.mark.parametrize("samples, match", [
    ([(1, 0, 1.0), (2, 0, 2.0)], "at least 3"),
    ([(1, 0, 1.0), (2, 0, float("nan")), (3, 0, 3.0)], "finite"),
    ([(1, 0, 1.0), (2, -3, 2.0), (3, 0, 3.0)], "K"),
    ([(1, 0, 1.0), (2, 0, -2.0), (3, 0, 3.0)], "seconds"),
    ([(0, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0)], "B must be >= 1"),
    ([(1, 0), (2, 0), (3, 0)], r"\(B, K, seconds\) triples"),
    ("abc", "triples"),
])
def test_fit_decode_bad_input(samples, match):
    with pytest.raises(ValueError, match=match):
        fit_decode_cost(samples)


def test_fit_decode_handoff_terms():
    """Decode-loop iterations (B, K, joined, left, seconds): the handoff terms are recovered,
    and the step terms stay what a plain fit gives."""
    d0, d1, d2, dj, dl = 0.002, 2e-5, 1e-8, 1.5e-3, 4e-4
    rows = [(B, K, j, lv, d0 + d1 * B + d2 * K + dj * j + dl * lv)
            for B, K in DECODE_GRID for j, lv in ((0, 0), (1, 0), (0, 2), (2, 1))]
    fit = fit_decode_cost(rows, handoff=True)
    assert (fit.d0, fit.d1, fit.d2, fit.dj, fit.dl) == pytest.approx((d0, d1, d2, dj, dl), rel=1e-9)
    assert fit.overhead(2, 1) == pytest.approx(2 * dj + dl) and "joined" in str(fit)
    plain = fit_decode_cost(synthetic_decode(d0, d1, d2))
    assert plain.dj == plain.dl == 0 and plain.overhead(3, 3) == 0 and "joined" not in str(plain)
    with pytest.raises(ValueError, match="joined, left"):
        fit_decode_cost(synthetic_decode(d0, d1, d2), handoff=True)
    with pytest.raises(ValueError, match="at least 5"):
        fit_decode_cost(rows[:4], handoff=True)


# ---- calibration against the real decode step ----------------------------------------------

def test_calibrate_decode_tiny_real(tiny_cfg, tiny_params):
    """A small real decode calibration on configs.tiny(): the fit explains the
    measurements (R^2 > 0.9). Steps of ~1-10 ms: the K = 32,000 corner's attention over
    the latent cache dominates the noise of a shared machine."""
    shapes = [(1, 128), (32, 128), (1, 1000), (32, 1000)]
    result = timing.calibrate_decode(tiny_params, tiny_cfg, shapes, repeats=5, holdout=[(16, 512)],
                                distinct_rows=8)
    assert result.fit.r2 > 0.9, result.table()
    assert [(B, K) for B, K, _ in result.samples] == [(B, B * L) for B, L in shapes]
    assert result.holdout[0][:2] == (16, 16 * 512)
    assert all(t > 0 for _, _, t in result.samples + result.holdout)
    assert set(result.repeats) == set(shapes) | {(16, 512)}
    assert all(len(v) == 5 for v in result.repeats.values())
    assert np.isfinite(result.median_error) and result.max_error >= result.median_error
    rows = result.rows()
    assert len(rows) == 5 and rows[-1]["split"] == "held-out" and rows[-1]["L"] == 512
    assert "held-out relative error" in result.table()
    by_min = result.refit(statistic="min")
    assert by_min.statistic == "min" and by_min.fit.n == 4
    assert by_min.samples[0][2] == min(result.repeats[shapes[0]])


def test_calibrate_decode_bad_input(tiny_cfg, tiny_params):
    ok = [(1, 8), (2, 8), (2, 16)]
    with pytest.raises(ValueError, match="at least 3"):
        timing.calibrate_decode(tiny_params, tiny_cfg, ok[:2])
    with pytest.raises(ValueError, match="separate"):       # K constant: d0 and d2 collide
        timing.calibrate_decode(tiny_params, tiny_cfg, [(1, 64), (2, 32), (4, 16)])
    with pytest.raises(ValueError, match="overlap"):
        timing.calibrate_decode(tiny_params, tiny_cfg, ok, holdout=[(1, 8)])
    with pytest.raises(ValueError, match="B >= 1"):
        timing.calibrate_decode(tiny_params, tiny_cfg, [(0, 8), (2, 8), (2, 16)])
    with pytest.raises(ValueError, match="L >= 1"):
        timing.calibrate_decode(tiny_params, tiny_cfg, [(1, 0), (2, 8), (2, 16)])
    with pytest.raises(ValueError, match="integer"):
        timing.calibrate_decode(tiny_params, tiny_cfg, [(1.5, 8), (2, 8), (2, 16)])
    with pytest.raises(ValueError, match="duplicate"):
        timing.calibrate_decode(tiny_params, tiny_cfg, [(1, 8), (1, 8), (2, 8), (2, 16)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        timing.calibrate_decode(tiny_params, tiny_cfg, [(1, 8), (2, 8), (2, 1024)])
    with pytest.raises(ValueError, match="statistic"):
        timing.calibrate_decode(tiny_params, tiny_cfg, ok, statistic="mean")
    for kwargs in (dict(repeats=0), dict(distinct_rows=0), dict(prefill_tokens=True)):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            timing.measure_decode(tiny_params, tiny_cfg, [(1, 8)], **kwargs)
