"""Searches, the dynamic P:D controller and bucket routing (the experiment runners built on them:
tests/experiments/test_serving.py)."""

import pytest

import pdjax
from pdjax import sim


@pytest.fixture(scope="module")
def cost():
    return sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)


def test_max_rate_bisection_finds_the_threshold():
    threshold = 3.7
    run = lambda r: {"slo_attainment": 1.0 if r <= threshold else 0.5}
    res = sim.max_rate_under_slo(run, lo=0.5, hi=2.0, rel_tol=0.01)
    assert res["feasible"] and threshold * (1 - 0.01) <= res["rate"] <= threshold
    assert not sim.max_rate_under_slo(lambda r: {"slo_attainment": 0.0}, lo=1, hi=2)["feasible"]
    with pytest.raises(ValueError, match="arrival rate"):
        sim.max_rate_under_slo(run, lo=-1, hi=2)


def test_attainment_falls_with_rate_and_the_search_brackets_it(cost):
    spec = sim.WorkloadSpec(num_requests=1, rate=1.0, input=2048, output=64, seed=0)
    slo = sim.SLO(ttft=0.5, tpot=0.02)
    run = sim.sweeps.rate_runner(spec, sim.PDDisaggregated(1, 1, link_bw=32 * 50e9), cost, slo, duration=10.0)
    res = sim.max_rate_under_slo(run, lo=1.0, hi=8.0, rel_tol=0.05)
    r = res["rate"]
    assert res["feasible"] and r > 1.0
    assert run(r)["slo_attainment"] >= 0.9
    assert run(r * 1.1)["slo_attainment"] < 0.9 or r * 1.1 > 8.0 * 2 ** 8


def test_pd_ratio_sweep_rows(cost):
    spec = sim.WorkloadSpec(num_requests=200, rate=30.0, input=2048, output=32, seed=1)
    rows = sim.pd_ratio_sweep(spec, cost, 4, sim.SLO(1.0, 0.05), prefill_counts=[1, 2, 3],
                              search_rate=False, pd_kwargs={"link_bw": 32 * 50e9})
    assert [r["label"] for r in rows] == ["1P3D", "2P2D", "3P1D"]
    assert all(0 <= r["slo_attainment"] <= 1 for r in rows)
    with pytest.raises(ValueError, match="link_bw"):
        sim.pd_ratio_sweep(spec, cost, 4, sim.SLO(1.0, 0.05), search_rate=False)


def test_controller_adds_prefill_when_prefill_is_the_bottleneck(cost):
    spec = sim.WorkloadSpec(num_requests=1500, rate=150.0, input=8192, output=16, seed=2)
    dep = sim.PDDisaggregated(1, 5, link_bw=32 * 50e9,
                              controller=sim.ControllerConfig(interval=0.5, cooldown=1.0))
    res = sim.simulate_serving(dep, cost, sim.sample_requests(spec), slo=sim.SLO(2.0, 0.05))
    s = res.summary
    assert s["controller_moves"] >= 1
    assert s["instances_prefill"] > 1 and s["instances_prefill"] + s["instances_decode"] == 6
    assert any(a[1].startswith("drain decode") for a in res.actions)
    static = sim.simulate_serving(sim.PDDisaggregated(1, 5, link_bw=32 * 50e9), cost, sim.sample_requests(spec),
                          slo=sim.SLO(2.0, 0.05)).summary
    assert s["ttft_p90"] < static["ttft_p90"]


def test_controller_holds_when_the_link_is_saturated(cost):
    spec = sim.WorkloadSpec(num_requests=800, rate=150.0, input=8192, output=16, seed=2)
    bw = 32 * 0.05e9       # handoff far slower than the prefill: the link is the bottleneck
    dep = sim.PDDisaggregated(1, 5, link_bw=bw, controller=sim.ControllerConfig(interval=0.5, cooldown=1.0))
    res = sim.simulate_serving(dep, cost, sim.sample_requests(spec))
    assert res.summary["controller_holds"] >= 1
    assert any("gains exhausted" in a[2] for a in res.actions)


def test_length_buckets_route_to_their_instances(cost):
    reqs = [sim.SimRequest(0, 0.0, 1000, 4), sim.SimRequest(1, 0.0, 20_000, 4), sim.SimRequest(2, 0.0, 70_000, 4),
            sim.SimRequest(3, 0.0, 300_000, 4)]
    dep = sim.PDDisaggregated(4, 1, link_bw=32 * 50e9, bucket_instances=[[0], [1], [2], [3]])
    res = sim.simulate_serving(dep, cost, reqs)
    assert [r.prefill_inst.iid for r in res.requests] == [0, 1, 2, 3]


def test_dp_ranks_balance_by_predicted_cost(cost):
    # one long and three short prompts on 2 ranks: the long one gets a rank to itself
    reqs = [sim.SimRequest(0, 0.0, 30_000, 2)] + [sim.SimRequest(i, 0.0, 1000, 2) for i in (1, 2, 3)]
    dep = sim.PDDisaggregated(1, 1, link_bw=32 * 50e9, dp_ranks=2, token_budget=65536)
    res = sim.simulate_serving(dep, cost, reqs)
    ranks = [r.prank for r in res.requests]
    assert ranks[0] != ranks[1] and ranks[1] == ranks[2] == ranks[3]


def test_time_budget_steps_fit_the_budget(cost):
    budget = 0.05
    reqs = [sim.SimRequest(0, 0.0, 60_000, 2)]
    dep = sim.PDDisaggregated(1, 1, link_bw=32 * 50e9, time_budget=budget, token_budget=1 << 20)
    res = sim.simulate_serving(dep, cost, reqs)
    p = res.requests[0].prefill_inst
    assert p.steps > 1
    assert p.busy_time <= p.steps * budget + 1e-12          # every step fits the budget
    assert p.busy_time >= cost.prefill_step_time([(60_000, 0)]) - 1e-9  # chunking costs, never saves
