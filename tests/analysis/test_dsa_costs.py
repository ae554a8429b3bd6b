"""DeepSeek-V3.2's sparse attention (DSA) in the analysis and the simulator: KV bytes per token
in both layouts, derived here from the config and the layouts' published byte counts; the
decode attention flat beyond index_topk while the indexer grows with the context, and the
prefill's indexer quadratic and attention linear (properties of the model, not its numbers);
DeepSeek-V3's outputs bit-equal to their recording (tests/analysis/v3_snapshot.py); the sheet
and the simulator's step costs for V3.2; bad inputs refused."""

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

import pdjax
from pdjax import analysis as A, sim
from pdjax.analysis import calibration as C, kv
from pdjax.analysis.kernels import KernelModel
from pdjax.analysis.opmodel import attention_part, sparse_attention_part
from pdjax.analysis.sparse_attention import (LOGIT_BYTES, attention_flops_per_pair, causal_pairs,
                                             indexer_flops_per_pair, selected_pairs, sparse_work)
from pdjax.sim.cost import has_totals
from pdjax.sim.cost_fit import linear_cost_from_deployments

import v3_snapshot


@pytest.fixture(scope="module")
def v32():
    return pdjax.configs.deepseek_v32()


@pytest.fixture(scope="module")
def v3():
    return pdjax.configs.deepseek_v3()


@pytest.fixture(scope="module")
def km():
    return KernelModel("h800")


# ---- KV bytes per token ---------------------------------------------------------------------

def test_kv_bytes_per_token_both_layouts(v32, v3):
    L, C_, R, Di = v32.num_hidden_layers, v32.kv_lora_rank, v32.qk_rope_head_dim, v32.index_head_dim
    assert (L, C_, R, Di) == (61, 512, 64, 128)
    # transformers' / pdjax's layout: the indexer key beside the latent, all in the cache dtype
    assert A.kv_bytes_per_token(v32, 2) == L * (C_ + R + Di) * 2 == L * v32.kv_latent_dim * 2 == 85_888
    assert A.kv_bytes_per_token(v32, 1) == L * (C_ + R + Di) == 42_944
    # DeepSeek's kernels: FP8 latent + a float32 scale per 128 values + BF16 RoPE (FlashMLA's
    # 656 B), FP8 indexer key + one float32 scale (DeepGEMM's "head_dim + 4")
    mla = C_ * 1 + (C_ // 128) * 4 + R * 2
    indexer = Di * 1 + (Di // 128) * 4
    assert (mla, indexer) == (656, 132)
    row = kv.kv_row_bytes(v32)
    assert (row["mla"], row["indexer"], row["total"]) == (mla, indexer, mla + indexer)
    assert A.kv_bytes_per_token(v32, layout="deepseek-fp8") == L * (mla + indexer) == 48_068
    assert kv.serving_kv_bytes_per_token(v32) == 48_068 and kv.serving_kv_layout(v32) == ("deepseek-fp8", 1)
    # V3: no indexer key; its kernels read the BF16 latent
    assert A.kv_bytes_per_token(v3, 2) == 61 * (512 + 64) * 2 == 70_272 == kv.serving_kv_bytes_per_token(v3)
    assert A.kv_bytes_per_token(v3, layout="deepseek-fp8") == 61 * 656
    assert kv.kv_row_bytes(v3, "uniform", 2) == {"latent": 1024, "latent_scales": 0, "rope": 128, "index_key": 0,
                                                 "index_scale": 0, "mla": 1152, "indexer": 0, "total": 1152}


# ---- decode: the attention flat beyond k, the indexer linear in the context -----------------

def _decode(km, cfg, ctx, q=1):
    return attention_part(km, cfg, decode=[(q, ctx)], moe=False)


def test_decode_attention_flat_beyond_topk_indexer_linear(km, v32):
    k = v32.index_topk
    a = {n: _decode(km, v32, n) for n in (k // 4, k // 2, 2 * k, 4 * k, 32 * k, 64 * k)}
    assert a[2 * k].attention == a[4 * k].attention == a[64 * k].attention > 0
    assert a[k // 4].attention < a[k // 2].attention < a[2 * k].attention
    assert a[64 * k].indexer / a[32 * k].indexer == pytest.approx(2, rel=1e-4)
    assert _decode(km, v32, 131072).indexer / _decode(km, v32, 32768).indexer == pytest.approx(4, rel=1e-4)
    # what the indexer reads per cached token: its FP8 key and scale, its FP32 logit twice
    w = sparse_work(v32, [(1, 131071)], kv.kv_row_bytes(v32))
    assert (w.selected, w.scored) == (k, 131072)
    assert w.indexer_bytes == 131072 * (132 + LOGIT_BYTES)


def test_decode_with_an_mtp_draft_selects_per_query(km, v32):
    """Two tokens a request (an MTP draft verified): each query gathers its own top-k."""
    k = v32.index_topk
    assert sparse_work(v32, [(2, 8 * k)], kv.kv_row_bytes(v32)).selected == 2 * k
    assert _decode(km, v32, 8 * k, q=2).attention == pytest.approx(2 * _decode(km, v32, 8 * k).attention)


def test_dense_v3_decode_grows_with_the_context(km, v3):
    t = [_decode(km, v3, n).attention for n in (4096, 32768, 131072)]
    assert t[2] / t[1] == pytest.approx(4, rel=1e-3) and t[1] / t[0] == pytest.approx(8, rel=1e-3)
    assert _decode(km, v3, 131072).indexer == 0.0


def test_sparse_decode_calibration_and_flashmla_check(km, v32):
    """410 TFLOPS at DeepSeek's configuration (batch 128, 128 heads, s_q 2, topk 2,048) is what
    calibrates the sparse kernel; FlashMLA's deep-dive then says its time there is "comparable
    to that of the dense decoding kernel when the sequence length is around 3000": the model's
    dense kernel (660 TFLOPS / 3,000 GB/s) matches it at a length within 2,500..3,500."""
    f = attention_flops_per_pair(v32)
    assert f == 2 * 128 * (576 + 512)
    flops = 128 * 2 * 2048 * f
    sparse = km.attention_decode_sparse(flops, 128 * 2 * 2048 * 656, 2048)
    assert sparse == pytest.approx(flops / 410e12, rel=1e-12)
    dense = lambda n: km.attention_decode(128 * 2 * (n + 2) * f, 128 * (n + 2) * 1152)
    lo, hi = 1, 100_000
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if dense(mid) < sparse else (lo, mid)
    assert 2500 <= hi <= 3500 and C.FLASHMLA_SPARSE["dense_equal_seq_len"] == 3000
    assert km.attention_decode_sparse(flops, 0, 32768) == pytest.approx(flops / 460e12, rel=1e-12)


# ---- prefill: the indexer O(T^2), the sparse attention O(T k) -------------------------------

@settings(max_examples=80, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000), st.integers(1, 3000))
def test_selected_pairs_closed_form(q, c, k):
    assert selected_pairs(q, c, k) == sum(min(c + i, k) for i in range(1, q + 1))
    assert causal_pairs(q, c) == sum(c + i for i in range(1, q + 1))


def test_prefill_indexer_quadratic_attention_linear(km, v32, v3):
    k = v32.index_topk
    part = lambda T: sparse_attention_part(km, v32, [(T, 0)], prefill=True)
    a, b = part(65536), part(131072)
    assert b.indexer / a.indexer == pytest.approx(4, rel=1e-3)           # O(T^2) at its small width
    sel = lambda T: selected_pairs(T, 0, k)
    assert b.attention / a.attention == pytest.approx(sel(131072) / sel(65536), rel=1e-12)   # O(T k)
    assert sel(131072) - sel(65536) == 65536 * k
    assert indexer_flops_per_pair(v32) == 2 * 64 * 128
    # DeepSeek's masked MHA mode for short prompts: V3's dense attention, chosen at 4K, not at 128K
    dense = lambda T: attention_part(km, v3, chunks=[(T, 0)], moe=False)
    assert part(4096).attention == dense(4096).attention
    assert part(131072).attention < dense(131072).attention / 4


# ---- DeepSeek-V3 bit-equal ---------------------------------------------------------------

def _compare(now, then, path=""):
    """Every recorded value equal (==, floats bit for bit); new keys allowed where zero (the
    indexer's op class) or under the sheet's new rows."""
    if isinstance(then, dict):
        assert isinstance(now, dict), path
        for key, value in then.items():
            assert key in now, f"{path}/{key} gone"
            _compare(now[key], value, f"{path}/{key}")
        for key in set(now) - set(then):
            new_row = path.startswith("/report") and key in ("decode", "mla_kv_per_token_deepseek_fp8_B")
            assert new_row or now[key] == 0, f"{path}/{key} = {now[key]!r} is new and not zero"
    else:
        assert now == then, f"{path}: {now!r} != recorded {then!r}"


def test_v3_outputs_bit_equal_to_the_recording():
    then = json.loads(v3_snapshot.FIXTURE.read_text())
    _compare(v3_snapshot.collect(), then)
    assert len(then["predict"]) == len(v3_snapshot.DEPLOYMENTS)


# ---- the sheet -----------------------------------------------------------------------------

def test_report_v32_shows_dsa(v32, v3):
    sheet = A.report(v32, "h800", ep_size=32, dtype="fp8")
    a, d = sheet.attention, sheet.decode
    assert a["mla_kv_per_token_B"] == 61 * 704 and a["mla_kv_per_token_deepseek_fp8_B"] == 48_068
    assert a["indexer_kv_per_token_B"] == 61 * 128 and a["index_topk"] == 2048
    assert sheet.roofline["compute_dtype"] == "fp8" and sheet.params["weight_dtype_bytes"] == 1
    assert d["kv_layout"] == "deepseek-fp8" and d["kv_per_token_B"] == 48_068
    att, idx = d["attention_per_request_layer_s"], d["indexer_per_request_layer_s"]
    assert att[4096] == att[32768] == att[131072]
    assert idx[131072] / idx[32768] == pytest.approx(4, rel=1e-4)
    assert "[decode]" in str(sheet) and "indexer_per_request_layer_s" in str(sheet)
    dense = A.report(v3, "h800", ep_size=32, dtype="fp8").decode
    assert dense["kv_layout"] == "uniform" and dense["indexer_per_request_layer_s"][131072] == 0
    for ctx in (32768, 131072):                  # the same instance serves V3.2 faster at long contexts
        assert d["tokens_per_s_per_gpu"][ctx] > 1.5 * dense["tokens_per_s_per_gpu"][ctx]
        assert att[ctx] < dense["attention_per_request_layer_s"][ctx] / 9


def test_report_dtype_shorthand_and_explicit_overrides(v3):
    fp8 = A.report(v3, "h800", ep_size=32, dtype="fp8", decode_contexts=())
    explicit = A.report(v3, "h800", ep_size=32, compute_dtype="fp8", weight_dtype_bytes=1, kv_dtype_bytes=1,
                        decode_contexts=())
    assert fp8.as_dict() == explicit.as_dict() and fp8.decode == {}
    mixed = A.report(v3, "h800", ep_size=32, dtype="fp8", kv_dtype_bytes=2, decode_contexts=())
    assert mixed.attention["mla_kv_per_token_B"] == 70_272 and mixed.params["weight_dtype_bytes"] == 1


# ---- the simulator's step costs -------------------------------------------------------------

def test_roofline_step_cost_v32(v32):
    cost = sim.LinearStepCost.from_roofline(v32, "h800", ep_size=32, dtype="fp8")
    k, L = v32.index_topk, v32.num_hidden_layers
    assert cost.sparse_topk == k and not has_totals(cost, "decode_step_time_totals")
    assert cost.kv_bytes == 61 * 704
    flat = cost.decode_step_time([4 * k]) - cost.decode_step_time([2 * k])
    assert flat == pytest.approx(cost.d2 * 2 * k, rel=1e-9)               # only the indexer grew
    assert cost.c5 == pytest.approx(attention_flops_per_pair(v32) * L / (32 * 1979e12))
    long = cost.prefill_step_time([(8192, 65536)]) - cost.prefill_step_time([(8192, 0)])
    assert long == pytest.approx(cost.c2 * 8192 * 65536 + cost.c4 * 65536 + cost.c5 * (
        selected_pairs(8192, 65536, k) - selected_pairs(8192, 0, k)), rel=1e-9)
    fp8 = sim.LinearStepCost.from_roofline(v32, "h800", ep_size=32, dtype="fp8", kv_layout="deepseek-fp8")
    assert fp8.kv_bytes == 48_068 and fp8.d3 >= 656 * L / (32 * 3.35e12)


def test_sparse_decode_step_is_its_formula_term_by_term(v32):
    """The decode step's sparse term (inlined for the simulator's per-step call) is d3 x
    selected_pairs(1, kv, k) per request, below, at and beyond k."""
    cost = sim.LinearStepCost.from_roofline(v32, "h800", ep_size=32, dtype="fp8", kv_layout="deepseek-fp8")
    k = cost.sparse_topk
    kv = [0, 1, k - 2, k - 1, k, k + 1, 4 * k, 100]
    want = cost.d0 + cost.d1 * len(kv) + cost.d2 * sum(kv) + cost.d3 * sum(selected_pairs(1, x, k) for x in kv)
    assert cost.decode_step_time(kv) == pytest.approx(want, rel=1e-12)
    assert cost.decode_attention_time(kv) - cost.a0 - cost.a1 * len(kv) - cost.d2 * sum(kv) == pytest.approx(
        cost.d3 * sum(min(x + 1, k) for x in kv), rel=1e-12)


def test_roofline_cost_model_v32(v32):
    """RooflineCostModel (the simulator's "roofline" cost): per layer, the attention's FLOPs
    stop growing at k, the indexer's grow by 2 Hi Di a cached token; a decode query reads the
    MLA part of its k rows and the indexer's key and logits of every token."""
    m = A.RooflineCostModel(v32, "h800")
    k = v32.index_topk
    op = {n: m.op_costs(kv_lens=[n])["attention"] for n in (k // 2, 2 * k, 4 * k)}
    assert op[4 * k].flops - op[2 * k].flops == indexer_flops_per_pair(v32) * 2 * k
    assert op[2 * k].flops - op[k // 2].flops == pytest.approx(
        indexer_flops_per_pair(v32) * 1.5 * k + attention_flops_per_pair(v32) * (k - (k // 2 + 1)))
    row = kv.kv_row_bytes(v32, "uniform", 2)
    assert op[4 * k].hbm_bytes - op[2 * k].hbm_bytes == (row["indexer"] + LOGIT_BYTES) * 2 * k
    assert m.kv_bytes_per_token() == 85_888
    pre = {T: m.op_costs(chunks=[(T, 0)])["attention"].flops for T in (65536, 131072)}
    idx = lambda T: indexer_flops_per_pair(v32) * causal_pairs(T, 0)
    att = lambda T: attention_flops_per_pair(v32) * selected_pairs(T, 0, k)
    proj = 2 * 65536 * A.param_counts(v32).attention // v32.num_hidden_layers     # the 65,536 more tokens' projections
    assert pre[131072] - pre[65536] == pytest.approx(idx(131072) - idx(65536) + att(131072) - att(65536) + proj)


def test_fitted_step_cost_v32_follows_predict(v32):
    """The opmodel-based cost (a LinearStepCost fitted to predict) keeps the attention flat
    beyond k: predict at 128K (outside the fitted 1K..16K) within 2 %."""
    pre = A.Deployment(v32, "h800", "prefill", gpus=32, ep=32)
    dec = A.Deployment(v32, "h800", "decode", gpus=32, ep=32)
    cost = linear_cost_from_deployments(pre, dec)
    assert cost.sparse_topk == 2048 and cost.d3 > 0 and cost.kv_bytes == 48_068
    for ctx in (32768, 131072):
        p = A.predict(A.Deployment(v32, "h800", "decode", gpus=32, ep=32, input_len=ctx, output_len=1,
                                   batch_per_gpu=64))
        assert cost.decode_step_time([ctx] * 64 * 32) == pytest.approx(p.step_time_s, rel=0.02)


def test_simulating_a_v32_deployment(v32):
    cost = sim.LinearStepCost.from_roofline(v32, "h800", ep_size=32, dtype="fp8")
    n_in, n_out = 9000, 12
    r = sim.simulate_serving(sim.Colocated(1, token_budget=16384), cost,
                             [sim.SimRequest(0, 0.0, n_in, n_out)]).requests[0]
    assert r.status == "finished"
    assert r.t_first == pytest.approx(cost.prefill_step_time([(n_in, 0)]), rel=1e-12)
    steps = sum(cost.decode_step_time([n_in + j]) for j in range(n_out - 1))
    assert r.t_finish - r.t_first == pytest.approx(steps, rel=1e-12)
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=60, rate=4.0, input=32768, output=64, seed=0))
    for dep in (sim.PDDisaggregated(1, 1, link_bw=32 * 50e9),
                sim.AFDisaggregated(1, 1, link_bw=32 * 50e9, num_attention=2, num_ffn=1)):
        res = sim.simulate_serving(dep, cost, reqs)
        assert res.summary["finished"] == 60


# ---- bad inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda c: A.kv_bytes_per_token(c, layout="fp4"), "unknown KV layout 'fp4'"),
    (lambda c: A.kv_bytes_per_token(c, 2, "mha", layout="deepseek-fp8"), "is an MLA row"),
    (lambda c: kv.kv_row_bytes(pdjax.configs.tiny_v32(), "deepseek-fp8"), "tiles of 128"),
    (lambda c: kv.kv_row_bytes(c, "uniform", 0), "dtype_bytes"),
    (lambda c: A.report(c, "h800", dtype="fp16"), "dtype must be one of"),
    (lambda c: A.report(c, "h800", decode_contexts=(4096, 0)), "decode_contexts"),
    (lambda c: sparse_work(pdjax.configs.deepseek_v3(), [(1, 10)], kv.kv_row_bytes(c)), "no sparse attention"),
    (lambda c: selected_pairs(4, 10, 0), "k must be"),
    (lambda c: sim.LinearStepCost.from_roofline(c, "h800", kv_layout="paged"), "unknown KV layout"),
    (lambda c: sim.LinearStepCost.from_roofline(c, "h800").decode_step_time_totals(4, 4096), "needs each request"),
    (lambda c: sim.LinearStepCost.from_roofline(c, "h800").prefill_step_time_totals(4, 0, 16), "needs each request"),
    (lambda c: sim.LinearStepCost(*[0.0] * 9, kv_bytes=1, c5=1e-9), "need sparse_topk"),
    (lambda c: sim.LinearStepCost(*[0.0] * 9, kv_bytes=1, sparse_topk=-1), "sparse_topk"),
    (lambda c: KernelModel("a100").indexer(1e9, 0), "peak_fp8_flops"),
])
def test_bad_inputs_refused(v32, call, match):
    with pytest.raises(ValueError, match=match):
        call(v32)


def test_kv_row_bytes_needs_a_config():
    with pytest.raises(TypeError, match="ModelConfig"):
        kv.kv_row_bytes({"kv_lora_rank": 512})
    assert math.isfinite(kv.kv_row_bytes(pdjax.configs.tiny_v32(), "uniform", 2)["total"])
