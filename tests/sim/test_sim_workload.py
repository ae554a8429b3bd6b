"""Workloads, traces and input validation."""

import json
import math

import numpy as np
import pytest

import pdjax
from pdjax import sim
from pdjax.analysis import HardwareSpec


def test_poisson_and_gamma_arrivals_have_the_requested_rate_and_cv():
    rng = np.random.default_rng(0)
    n = 200_000
    for cv in (1.0, 0.5, 2.0):
        gaps = sim.workload.arrival_gaps(rng, 10.0, n, cv)
        # standard errors: mean sigma/sqrt(n); allow 6 of them
        assert abs(gaps.mean() - 0.1) < 6 * 0.1 * cv / math.sqrt(n)
        assert abs(gaps.std() / gaps.mean() - cv) < 0.05 * cv


def test_length_distributions():
    rng = np.random.default_rng(1)
    assert (sim.length_dist(7).sample(rng, 5) == 7).all()
    u = sim.length_dist({"kind": "uniform", "low": 3, "high": 5}).sample(rng, 1000)
    assert set(u.tolist()) == {3, 4, 5}
    ln = sim.length_dist({"kind": "lognormal", "mean": 1000, "cv": 0.5}).sample(rng, 100_000)
    assert abs(ln.mean() - 1000) < 10 and abs(ln.std() / ln.mean() - 0.5) < 0.02
    assert set(sim.length_dist([10, 20]).sample(rng, 100).tolist()) == {10, 20}
    with pytest.raises(ValueError, match="unknown length distribution"):
        sim.length_dist({"kind": "zipf"})
    with pytest.raises(ValueError, match="uniform"):
        sim.length_dist({"kind": "uniform", "low": 5, "high": 2})


def test_multi_turn_sessions_extend_their_context_and_share_system_prompts():
    spec = sim.WorkloadSpec(num_requests=400, rate=5.0, input=100, output=30, system_prompts=3,
                            system_prompt_len=500, turns=4, think_time=2.0, seed=2)
    reqs = sim.sample_requests(spec)
    assert len(reqs) == 400 and [r.rid for r in reqs] == list(range(400))
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        assert turns[0].segments[0][0] < 3 and turns[0].segments[0][1] == 500   # system prompt
        for prev, nxt in zip(turns, turns[1:]):
            ctx = prev.segments + ((prev.out_segment, prev.output_len),)
            assert nxt.segments[:len(ctx)] == ctx                     # previous context is a prefix
            assert nxt.input_len == prev.input_len + prev.output_len + 100
            assert nxt.arrival >= prev.arrival
    assert reqs[0].input_len == 600


def test_multi_turn_prefix_cache_hits_what_the_previous_turn_wrote():
    cost = sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)
    # two turns far apart: the second turn's cached prefix is the first turn's whole context,
    # rounded down to full blocks
    spec = sim.WorkloadSpec(num_requests=2, rate=1e-3, input=1000, output=50, turns=2,
                            think_time=1e4, seed=0)
    reqs = sim.sample_requests(spec)
    assert reqs[1].session_id == reqs[0].session_id
    bs = 64
    res = sim.simulate_serving(sim.Colocated(1), cost, reqs, prefix_cache=sim.PrefixCache(1000, bs))
    r0, r1 = res.requests
    assert r0.cached == 0
    assert r1.cached == (1000 + 50) // bs * bs


def test_trace_replay_csv_and_jsonl(tmp_path):
    rows = [dict(arrival_time=0.5, input_len=100, output_len=10, session_id="s1"),
            dict(arrival_time=0.1, input_len=300, output_len=5, prefix_id="sys", prefix_len=200),
            dict(arrival_time=2.0, input_len=150, output_len=4, session_id="s1")]
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    csvp = tmp_path / "t.csv"
    cols = ["arrival_time", "input_len", "output_len", "session_id", "prefix_id", "prefix_len"]
    csvp.write_text(",".join(cols) + "\n" + "\n".join(
        ",".join(str(r.get(c, "")) for c in cols) for r in rows))
    for path in (jl, csvp):
        reqs = sim.load_trace(str(path))
        assert [r.arrival for r in reqs] == [0.1, 0.5, 2.0]
        assert reqs[0].segments[0][1] == 200 and reqs[0].input_len == 300
        first, second = reqs[1], reqs[2]
        ctx = first.segments + ((first.out_segment, first.output_len),)
        assert second.segments[:len(ctx)] == ctx and second.input_len == 150


def test_trace_errors_name_the_problem(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("arrival_time,input_len\n0.0,10\n")
    with pytest.raises(ValueError, match=r"missing required column\(s\) \['output_len'\]"):
        sim.load_trace(str(p))
    p.write_text("arrival_time,input_len,output_len\n0.0,-3,5\n")
    with pytest.raises(ValueError, match="row 1 column 'input_len'"):
        sim.load_trace(str(p))
    p.write_text("arrival_time,input_len,output_len\nsoon,3,5\n")
    with pytest.raises(ValueError, match="not a number"):
        sim.load_trace(str(p))
    with pytest.raises(ValueError, match="does not exist"):
        sim.load_trace(str(tmp_path / "nope.csv"))
    q = tmp_path / "x.jsonl"
    q.write_text('{"arrival_time": 0, "input_len": 5, "output_len": 2, "prefix_id": 1}\n')
    with pytest.raises(ValueError, match="prefix_len"):
        sim.load_trace(str(q))


@pytest.mark.parametrize("rate", [-1.0, 0.0, math.inf, math.nan])
def test_bad_rates(rate):
    with pytest.raises(ValueError, match="arrival rate"):
        sim.WorkloadSpec(num_requests=10, rate=rate)


@pytest.mark.parametrize("ttft,tpot", [(0.0, 0.1), (1.0, -0.1), (math.inf, 0.1)])
def test_impossible_slos(ttft, tpot):
    with pytest.raises(ValueError, match="SLO"):
        sim.SLO(ttft=ttft, tpot=tpot)


def test_hardware_without_a_needed_figure_is_surfaced():
    cfg = pdjax.configs.deepseek_v3()
    with pytest.raises(ValueError, match="a100.*peak_fp8_flops"):
        sim.LinearStepCost.from_roofline(cfg, "a100", dtype="fp8")
    bare = HardwareSpec("no-bw-gpu", peak_bf16_flops=1e15)
    with pytest.raises(ValueError, match="no-bw-gpu.*hbm_bw"):
        sim.LinearStepCost.from_roofline(cfg, bare)


def test_bad_deployments_and_cost_models():
    with pytest.raises(ValueError, match="num_prefill"):
        sim.PDDisaggregated(0, 1, link_bw=1e9)
    with pytest.raises(ValueError, match="link_bw"):
        sim.PDDisaggregated(1, 1, link_bw=-5)
    with pytest.raises(ValueError, match="bucket_instances"):
        sim.PDDisaggregated(2, 1, link_bw=1e9, bucket_instances=[[0], [1]])
    with pytest.raises(ValueError, match="microbatches"):
        sim.AFDisaggregated(1, 1, link_bw=1e9, microbatches=0)
    with pytest.raises(TypeError, match="lacks"):
        sim.simulate_serving(sim.Colocated(1), object(), [])
    with pytest.raises(ValueError, match="horizon"):
        sim.simulate_serving(sim.Colocated(1), sim.LinearStepCost.from_roofline(
            pdjax.configs.tiny(), "h100"), [], horizon=-1)
