"""The deployment predictor (pdjax.analysis.predict): calibrated on DeepSeek's releases only,
held against independent measurements, and moving the way physics says when a source row
changes. Expected values are the published figures themselves (pdjax.analysis.calibration,
pdjax.analysis.validation_set) or closed forms computed here from the config."""

import ast
import dataclasses
import math
import pathlib

import pytest

import pdjax
from pdjax import analysis as A
from pdjax.analysis import calibration as C
from pdjax.analysis import deploy, kernels, validation_set
from pdjax.analysis.routing import route_stats
from pdjax.analysis.train_pair import predict_train_pair

ANALYSIS = pathlib.Path(A.__file__).parent
MODEL_MODULES = ("calibration", "kernels", "routing", "opmodel", "overlap", "streams", "deploy", "memory_fit",
                 "train_pair", "hardware")


@pytest.fixture(scope="module")
def v3():
    return pdjax.configs.deepseek_v3()


@pytest.fixture
def fresh_calibration():
    """Clear every cache derived from the calibration tables before and after the test."""
    deploy.clear_caches()
    yield
    deploy.clear_caches()


def _sglang(v3, **kw):
    base = dict(hardware="h100-sxm", role="prefill", gpus=32, ep=32, input_len=4096, batch_per_gpu=16384,
                gemm_kernels=validation_set.SGLANG_KERNELS)
    return A.Deployment(v3, **{**base, **kw})


# ---- calibration and validation stay apart ----------------------------------------------------

def test_no_model_module_reads_the_validation_set():
    """The model's modules neither import the validation set nor hold one of its figures."""
    figures = {str(int(m.tokens_per_s_per_node)) for m in validation_set.MEASURED}
    figures |= {f"{int(m.tokens_per_s_per_node):_}" for m in validation_set.MEASURED}
    for name in MODEL_MODULES:
        src = (ANALYSIS / f"{name}.py").read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                assert not any("validation_set" in n for n in names), f"{name}.py imports the validation set"
        found = [f for f in figures if f in src]
        assert not found, f"{name}.py holds validation figures {found}"


def test_deepseek_profiles_are_reproduced_in_sample():
    """DeepSeek's profile throughputs (62,713 prefill, 18,598 decode per node) within 5 %."""
    for p in C.DEEPSEEK_PROFILE:
        got = A.predict(deploy.profile_deployment(p.role)).tokens_per_s_per_node
        assert got == pytest.approx(p.tokens_per_s_per_node, rel=0.05), p.role


def test_train_pair_matches_the_trace(v3):
    """train.json's F&B chunk pair: each of gemm, attention, dispatch, combine within 15 %,
    the makespan within 10 %."""
    pair = predict_train_pair(v3)
    raw = C.TRAIN_PROFILE_RAW
    for cls in ("gemm", "attention", "dispatch", "combine"):
        assert pair.op_times[cls] == pytest.approx(raw["class_us"][cls] * 1e-6, rel=0.15), cls
    assert pair.makespan_s == pytest.approx(raw["makespan_us"] * 1e-6, rel=0.10)


def test_train_pair_overlap_is_what_meets_the_makespan(v3):
    """Serialising the pair (no op overlaps another) misses the measured makespan: the
    overlap model, not the op sums, is what lands within 10 %."""
    pair = predict_train_pair(v3)
    serial = sum(s.duration_s for s in pair.spans)
    assert serial > 1.1 * C.TRAIN_PROFILE_RAW["makespan_us"] * 1e-6 > pair.makespan_s * 0.99


# ---- the validation gates --------------------------------------------------------------------

def _rows():
    return {r["name"]: r for r in validation_set.validation_rows()}


@pytest.fixture(scope="module")
def rows():
    return _rows()


@pytest.mark.parametrize("name", [
    "SGLang prefill EP32, 4K prompts, simulated perfect EPLB",
    "SGLang decode EP72, simulated MTP (60 %), 128 requests per GPU, 4K KV",
    "SGLang prefill two-batch-overlap gain",
])
def test_validation_gates_that_hold(rows, name):
    r = rows[name]
    assert r["holds"], r
    if r["error"] is not None:
        assert abs(r["error"]) <= r["gate"]


@pytest.mark.xfail(strict=True, reason="open: SGLang's decode runs 12 % slower than the model; see "
                                       "docs/validation.md")
def test_validation_decode_256(rows):
    assert rows["SGLang decode EP72, 256 requests per GPU, 2K inputs"]["holds"]


@pytest.mark.xfail(strict=True, reason="open: the default placement's imbalance needs a skewed expert "
                                       "popularity the model does not have yet; see docs/validation.md")
@pytest.mark.parametrize("k", [1, 2, 4])
def test_validation_default_placement(rows, k):
    assert rows[f"SGLang prefill EP32, {k}K prompts, default placement"]["holds"]


# ---- physics: which way a prediction moves ----------------------------------------------------

def test_h800_slower_than_h100_only_where_nvlink_carries_traffic(v3):
    """Prefill at EP16 (the NVLink leg binds on H800), EP32 (it pipelines behind RDMA) and
    EP8 (all NVLink): H800 slower. Decode's low-latency kernels (pure RDMA): identical."""
    for ep in (8, 16, 32):
        d = dict(role="prefill", gpus=ep, ep=ep, input_len=4096, batch_per_gpu=8192, overlap=None,
                 hardware="h800")
        h800 = A.predict(A.Deployment(v3, **{**d, "hardware": _with_memory("h800")}))
        h100 = A.predict(A.Deployment(v3, **{**d, "hardware": _with_memory("h100-sxm")}))
        assert h800.step_time_s > h100.step_time_s, ep
        assert h800.breakdown["dispatch"] > h100.breakdown["dispatch"], ep
    dec = dict(role="decode", gpus=72, ep=72, input_len=2000, batch_per_gpu=256)
    h800 = A.predict(A.Deployment(v3, hardware="h800", **dec))
    h100 = A.predict(A.Deployment(v3, hardware="h100-sxm", **dec))
    assert h800.step_time_s == h100.step_time_s


def _with_memory(name):
    """``name`` with 200 GB of HBM (so EP8 and EP16 hold the weights; nothing else changes)."""
    return dataclasses.replace(A.hardware(name), name=f"{name}-200gb", hbm_bytes=200e9)


def test_longer_prompts_prefill_slower_per_token(v3):
    tput = [A.predict(_sglang(v3, input_len=L)).tokens_per_s_per_gpu for L in (1024, 2048, 4096, 8192)]
    assert tput == sorted(tput, reverse=True) and tput[0] > tput[-1] * 1.05


def test_more_network_bandwidth_is_faster(v3):
    """A NIC of twice the bandwidth shortens a prefill whose all-to-all is exposed."""
    fast = dataclasses.replace(A.hardware("h100-sxm"), name="h100-2x-nic", scale_out_bw=100e9)
    slow = A.predict(_sglang(v3, overlap=None))
    quick = A.predict(_sglang(v3, overlap=None, hardware=fast))
    assert quick.breakdown["dispatch"] < slow.breakdown["dispatch"]
    assert quick.step_time_s < slow.step_time_s


def _bump(monkeypatch, obj, attr, new):
    monkeypatch.setattr(obj, attr, new)
    deploy.clear_caches()


def test_a_faster_gemm_row_speeds_up_prefill(v3, monkeypatch, fresh_calibration):
    before = A.predict(_sglang(v3, overlap=None)).breakdown["gemm"]
    table = tuple(dataclasses.replace(p, tflops=p.tflops * 1.2) if (p.m, p.n, p.k) == (4096, 7168, 16384) else p
                  for p in C.DEEPGEMM_2025_04)
    _bump(monkeypatch, C, "GEMM_KERNELS", {**C.GEMM_KERNELS, "deepgemm-2025-04": (table, False, "test")})
    assert A.predict(_sglang(v3, overlap=None)).breakdown["gemm"] < before


def test_faster_attention_kernels_speed_up_both_phases(v3, monkeypatch, fresh_calibration):
    pre = A.predict(_sglang(v3, overlap=None)).breakdown["attention"]
    dec = dict(role="decode", gpus=72, ep=72, input_len=4000, batch_per_gpu=128, overlap=None)
    d0 = A.predict(_sglang(v3, **dec)).breakdown["attention"]
    raw = {**C.TRAIN_PROFILE_RAW, "fa_fwd_us": tuple(t * 0.8 for t in C.TRAIN_PROFILE_RAW["fa_fwd_us"])}
    _bump(monkeypatch, C, "TRAIN_PROFILE_RAW", raw)
    monkeypatch.setattr(C, "FLASHMLA_DECODE", {"memory_gbps": 3300.0, "compute_tflops": 800.0})
    assert A.predict(_sglang(v3, overlap=None)).breakdown["attention"] < pre
    assert A.predict(_sglang(v3, **dec)).breakdown["attention"] < d0


@pytest.mark.parametrize("row_ep,which", [(32, "dispatch"), (32, "combine")])
def test_more_deepep_bandwidth_is_faster(v3, monkeypatch, fresh_calibration, row_ep, which):
    before = A.predict(_sglang(v3, overlap=None)).breakdown[which]
    rows = tuple(dataclasses.replace(r, dispatch_gbps=r.dispatch_gbps * 1.5, combine_gbps=r.combine_gbps * 1.5)
                 if r.ep == row_ep else r for r in C.DEEPEP_NORMAL)
    _bump(monkeypatch, C, "DEEPEP_NORMAL", rows)
    assert A.predict(_sglang(v3, overlap=None)).breakdown[which] < before


def test_more_low_latency_bandwidth_is_faster_decode(v3, monkeypatch, fresh_calibration):
    dec = dict(role="decode", gpus=64, ep=64, input_len=2000, batch_per_gpu=256, overlap=None)
    before = A.predict(_sglang(v3, **dec))
    rows = tuple(dataclasses.replace(r, dispatch_gbps=r.dispatch_gbps * 2, combine_gbps=r.combine_gbps * 2)
                 for r in C.DEEPEP_LOW_LATENCY)
    _bump(monkeypatch, C, "DEEPEP_LOW_LATENCY", rows)
    after = A.predict(_sglang(v3, **dec))
    assert after.breakdown["dispatch"] == pytest.approx(before.breakdown["dispatch"] / 2)
    assert after.step_time_s < before.step_time_s


def test_fewer_other_kernels_is_faster(v3, monkeypatch, fresh_calibration):
    before = A.predict(_sglang(v3, overlap=None)).breakdown["other"]
    raw = {**C.TRAIN_PROFILE_RAW, "other_fwd_us": C.TRAIN_PROFILE_RAW["other_fwd_us"] - 2000}
    _bump(monkeypatch, C, "TRAIN_PROFILE_RAW", raw)
    assert A.predict(_sglang(v3, overlap=None)).breakdown["other"] < before


# ---- the pieces against closed forms ------------------------------------------------------------

def test_routing_nodes_per_token_closed_form():
    """DeepEP's benchmark on 2 nodes: 8 of 256 experts, uniformly; a node holds 128, so it is
    missed with probability C(128, 8) / C(256, 8)."""
    s = route_stats(256, 8, 2, 2, 16, 8, 4096)
    miss = math.comb(128, 8) / math.comb(256, 8)
    assert s.nodes_per_token == pytest.approx(2 * (1 - miss), rel=0.005)
    gpus = 16 * (1 - math.comb(240, 8) / math.comb(256, 8))
    assert s.ranks_per_token == pytest.approx(gpus, rel=0.01)


def test_redundant_slots_that_cannot_balance_show_as_imbalance():
    """288 slots on 72 GPUs with uniform expert loads: 32 experts get two replicas (half load
    each), so some GPU holds four whole experts: at least 4 / (256 / 72) = 1.125."""
    s = route_stats(256, 8, 8, 4, 72, 8, 1 << 20, slots=288)
    assert s.rows_imbalance >= 4 / (256 / 72) and s.rows_imbalance < 4 / (256 / 72) * 1.01


def test_deepep_ep16_row_is_reproduced_on_h800():
    """The internode kernels' NVLink leg is calibrated where DeepEP's EP16 benchmark is
    NVLink-bound: the model gives back its 43 GB/s; EP32 and EP64 (RDMA-bound) their rows."""
    km = kernels.KernelModel("h800")
    b = C.DEEPEP_NORMAL_BENCH
    for row in C.DEEPEP_NORMAL[1:]:
        nodes = row.ep // 8
        s = route_stats(b["experts"], b["top_k"], nodes, min(nodes, b["max_nodes"]), row.ep, 8, b["tokens"])
        rdma = b["tokens"] * s.nodes_per_token * b["hidden"] * 2
        nvl = b["tokens"] * s.ranks_per_token * b["hidden"] * 2
        t = km.normal_a2a(rdma, nvl, row.ep, combine=True)
        assert rdma / t / 1e9 == pytest.approx(row.combine_gbps, rel=0.05), row.ep


def test_deepgemm_rows_are_reproduced(fresh_calibration):
    km = kernels.KernelModel("h800")
    for p in C.DEEPGEMM_2025_04:
        t = km.gemm(p.m, p.n, p.k, groups=p.groups, grouped=p.layout != "normal")
        assert 2 * p.groups * p.m * p.n * p.k / t / 1e12 == pytest.approx(p.tflops, rel=0.02), p


# ---- the API ------------------------------------------------------------------------------------

def test_prediction_fields_and_face(v3):
    from pdjax.analysis import memory_fit
    d = A.Deployment(v3, "h800", "decode", gpus=144, ep=144, input_len=4096)
    p = A.predict(d)
    assert p.tokens_per_s_per_node == pytest.approx(8 * p.tokens_per_s_per_gpu)
    assert set(p.breakdown) == set(A.streams.OP_CLASSES)
    free = 80e9 * (1 - memory_fit.ACTIVATION_RESERVE) - memory_fit.weight_bytes_per_gpu(d)
    by_memory = int(free // (A.kv_bytes_per_token(v3, 2) * (4096 + 100)))
    assert p.batch_per_gpu == min(2 * 128, by_memory) and "memory-limited" in p.notes[0]
    assert p.step_time_s > 0
    assert len(A.__all__) <= 25 and {"Deployment", "predict", "read_profile"} <= set(A.__all__)


@pytest.mark.parametrize("kw,match", [
    (dict(role="train"), "Deployment.role must be one of"),
    (dict(ep=24), "not a multiple of ep=24"),
    (dict(role="prefill", mtp=0.6), "mtp applies to decode"),
    (dict(expert_load="skewed"), "Deployment.expert_load"),
    (dict(cache_hit_rate=1.0), "cache_hit_rate must be < 1"),
    (dict(redundant_experts=3), "do not split evenly"),
    (dict(gemm_kernels="cublas"), "unknown GEMM kernel set 'cublas'"),
])
def test_bad_deployments_are_refused_before_any_work(v3, kw, match):
    base = dict(hardware="h800", role="decode", gpus=32, ep=32)
    with pytest.raises(ValueError, match=match):
        A.predict(A.Deployment(v3, **{**base, **kw}))


def test_weights_that_do_not_fit_are_named(v3):
    with pytest.raises(ValueError, match=r"do not fit h100-sxm's 80 GB at ep=8"):
        A.predict(A.Deployment(v3, "h100-sxm", "prefill", gpus=8, ep=8))
