"""DeepSeek-V3's cost-model outputs, recorded so that a change made for another model (V3.2's
sparse attention) can be held to leaving V3 bit-equal: ``collect()`` computes them,
``python tests/analysis/v3_snapshot.py`` writes ``tests/fixtures/v3_costs.json`` (floats as
their repr, so the JSON round-trip is exact), and tests/analysis/test_dsa_costs.py compares.

Covered: KV bytes per token, the analysis sheet, the deployment predictor (step time, rates,
batch, imbalance, notes, every op class's time and a hash of the timeline) over prefill and
decode deployments of several hardware, overlaps, MTP and loads, the two calibrated
all-to-all factors, the DualPipe training pair, and the simulator's three step costs
(LinearStepCost.from_roofline, the fit to the predictor, RooflineCostModel).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "v3_costs.json"

#: (hardware, role, gpus, ep, extra Deployment fields)
DEPLOYMENTS = (
    ("h800", "decode", 32, 32, {}),
    ("h800", "decode", 144, 144, {"mtp": 0.6, "input_len": 4989}),
    ("h800", "decode", 32, 32, {"overlap": None, "input_len": 32768, "batch_per_gpu": 8}),
    ("h800", "decode", 32, 32, {"input_len": 131072, "batch_per_gpu": 2}),
    ("h100-sxm", "decode", 72, 72, {"input_len": 2000, "expert_load": "balanced"}),
    ("gb200", "decode", 72, 72, {"input_len": 4096}),
    ("h800", "prefill", 32, 32, {}),
    ("h800", "prefill", 32, 32, {"cache_hit_rate": 0.5, "input_len": 8192}),
    ("h200", "prefill", 16, 16, {"overlap": None, "weight_dtype": "bf16"}),
    ("h100-sxm", "prefill", 32, 32, {"input_len": 32768, "batch_per_gpu": 32768}),
)


def _span_hash(spans) -> str:
    rows = [(s.stream, s.op_class, repr(s.start_s), repr(s.end_s), s.label, s.group) for s in spans]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _cost_fields(cost) -> dict:
    return {f.name: getattr(cost, f.name) for f in dataclasses.fields(cost) if f.name != "cfg"}


def _predictions(v3) -> dict:
    from pdjax import analysis as A
    out = {}
    for hw, role, gpus, ep, extra in DEPLOYMENTS:
        p = A.predict(A.Deployment(v3, hw, role, gpus=gpus, ep=ep, **extra))
        key = f"{hw}/{role}/{gpus}/{ep}/{sorted(extra.items())}"
        out[key] = {"step_time_s": p.step_time_s, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                    "tokens_per_s_per_node": p.tokens_per_s_per_node, "batch_per_gpu": p.batch_per_gpu,
                    "imbalance": p.imbalance, "notes": list(p.notes), "breakdown": dict(p.breakdown),
                    "spans": _span_hash(p.spans)}
    return out


def _sim_costs(v3) -> dict:
    from pdjax import analysis as A
    from pdjax.sim.cost import LinearStepCost
    from pdjax.sim.cost_fit import linear_cost_from_deployments
    out = {}
    for hw, kw in (("h800", {}), ("h800", {"dtype": "fp8", "ep_size": 32}), ("h100-sxm", {"ep_size": 8, "mfu": 0.5}),
                   ("h200", {"kv_dtype_bytes": 1, "ep_size": 16})):
        out[f"from_roofline/{hw}/{sorted(kw.items())}"] = _cost_fields(LinearStepCost.from_roofline(v3, hw, **kw))
    fit = linear_cost_from_deployments(A.Deployment(v3, "h800", "prefill", gpus=32, ep=32),
                                       A.Deployment(v3, "h800", "decode", gpus=32, ep=32))
    out["fit/h800/32"] = _cost_fields(fit)
    for dtype_bytes, ep in ((2, 1), (1, 32)):
        m = A.RooflineCostModel(v3, "h800", dtype_bytes=dtype_bytes, ep_size=ep)
        out[f"roofline/{dtype_bytes}/{ep}"] = {
            "prefill": [m.prefill_step_time(c) for c in ([(4096, 0)], [(1024, 3072), (512, 0)], [(8192, 32768)])],
            "decode": [m.decode_step_time(k) for k in ([4096] * 64, [100, 32768, 131072], [2047, 2048, 2049])],
            "attention": m.decode_attention_time([4096] * 8), "ffn": m.decode_ffn_time(8),
            "kv_bytes": m.kv_bytes_per_token(), "transfer": m.kv_transfer_time(4096, 50e9)}
    return out


def collect() -> dict:
    """Every recorded output of DeepSeek-V3 (JSON-ready)."""
    import pdjax
    from pdjax import analysis as A
    from pdjax.analysis import deploy
    from pdjax.analysis.train_pair import predict_train_pair
    v3 = pdjax.configs.deepseek_v3()
    kv = {f"{kind}/{p}": A.kv_bytes_per_token(v3, p, kind) for kind in ("mla", "mha", "mqa") for p in (1, 2)}
    sheets = {}
    for hw, kw in (("h800", {}), ("h800", {"ep_size": 32, "weight_dtype_bytes": 1}),
                   ("h100-sxm", {"context_len": 4989, "ep_size": 144, "weight_dtype_bytes": 1}),
                   ("a100", {"ep_size": 64, "kv_dtype_bytes": 1})):
        sheets[f"{hw}/{sorted(kw.items())}"] = A.report(v3, hw, **kw).as_dict()
    pair = predict_train_pair(v3)
    return json.loads(json.dumps({
        "kv_bytes_per_token": kv, "report": sheets, "predict": _predictions(v3),
        "comm_factor": {r: deploy.comm_factor(r) for r in ("prefill", "decode")},
        "train_pair": {"makespan_s": pair.makespan_s, "op_times": dict(pair.op_times)},
        "sim": _sim_costs(v3)}))


if __name__ == "__main__":
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(collect(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
