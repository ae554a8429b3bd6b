"""Simulator results against hand-derived cases, conservation and determinism."""


import pytest
from hypothesis import given, settings, strategies as st

import pdjax
from pdjax import sim
from pdjax.sim.workload import SimRequest


@pytest.fixture(scope="module")
def cost():
    return sim.LinearStepCost.from_roofline(pdjax.configs.deepseek_v3(), "h800", ep_size=32)


def one(input_len, output_len, arrival=0.0, rid=0):
    return SimRequest(rid, arrival, input_len, output_len)


def decode_sum(cost, input_len, output_len):
    """Sum of the decode steps of one request alone: step j (j = 0 .. output_len - 2) feeds
    output token j + 1 with input_len + j tokens already cached."""
    return sum(cost.decode_step_time([input_len + j]) for j in range(output_len - 1))


def test_single_request_colocated(cost):
    n_in, n_out = 3000, 17
    res = sim.simulate_serving(sim.Colocated(1, token_budget=4096), cost, [one(n_in, n_out)])
    r = res.requests[0]
    assert r.status == "finished"
    assert r.t_first == pytest.approx(cost.prefill_step_time([(n_in, 0)]), rel=1e-12)
    tpot = (r.t_finish - r.t_first) / (n_out - 1)
    assert tpot == pytest.approx(decode_sum(cost, n_in, n_out) / (n_out - 1), rel=1e-12)
    # two output tokens: TPOT is exactly one decode step
    r2 = sim.simulate_serving(sim.Colocated(1, token_budget=4096), cost, [one(n_in, 2)]).requests[0]
    assert r2.t_finish - r2.t_first == pytest.approx(cost.decode_step_time([n_in]), rel=1e-12)


def test_chunked_prefill_ttft_is_sum_of_chunks(cost):
    n_in, budget = 5000, 2048
    r = sim.simulate_serving(sim.Colocated(1, token_budget=budget), cost, [one(n_in, 4)]).requests[0]
    chunks, done = [], 0
    while done < n_in:
        q = min(budget, n_in - done)
        chunks.append((q, done))
        done += q
    assert r.t_first == pytest.approx(sum(cost.prefill_step_time([c]) for c in chunks), rel=1e-12)


@pytest.mark.parametrize("bw", [32 * 50e9, 32 * 2e9, 32 * 0.5e9])
@pytest.mark.parametrize("layerwise", [True, False])
def test_pd_exposed_transfer_layerwise(cost, bw, layerwise):
    n_in, n_out = 8192, 9
    L = pdjax.configs.deepseek_v3().num_hidden_layers
    dep = sim.PDDisaggregated(1, 1, link_bw=bw, layerwise=layerwise)
    r = sim.simulate_serving(dep, cost, [one(n_in, n_out)]).requests[0]
    t_pre = cost.prefill_step_time([(n_in, 0)])
    x = cost.kv_transfer_time(n_in, bw)
    exposed = max(x / L, x - t_pre * (L - 1) / L) if layerwise else x
    assert r.t_first == pytest.approx(t_pre, rel=1e-12)
    assert r.kv_wait == pytest.approx(exposed, rel=1e-9)
    assert r.t_finish - r.t_first == pytest.approx(exposed + decode_sum(cost, n_in, n_out), rel=1e-9)


def test_pd_output_one_token_needs_no_transfer(cost):
    res = sim.simulate_serving(sim.PDDisaggregated(1, 1, link_bw=1e9), cost, [one(1000, 1)])
    r = res.requests[0]
    assert r.t_finish == r.t_first == pytest.approx(cost.prefill_step_time([(1000, 0)]))
    assert res.summary["transfer_bytes"] == 0


def test_backpressure_waits_for_decode_slot(cost):
    n_in, n_out = 1000, 5
    dep = sim.PDDisaggregated(1, 1, link_bw=32 * 50e9, kv_capacity=n_in + n_out)
    res = sim.simulate_serving(dep, cost, [one(n_in, n_out, 0.0, 0), one(n_in, n_out, 0.0, 1)])
    a, b = res.requests
    assert a.t_handshake == 0.0
    assert b.t_handshake == pytest.approx(a.t_finish)          # slot freed by a's finish
    assert b.t_first == pytest.approx(a.t_finish + cost.prefill_step_time([(n_in, 0)]))


def test_oversized_request_is_rejected_with_reason(cost):
    dep = sim.PDDisaggregated(1, 1, link_bw=1e9, kv_capacity=100)
    res = sim.simulate_serving(dep, cost, [one(90, 20), one(50, 10, 0.1, 1)])
    assert [r.status for r in res.requests] == ["rejected", "finished"]
    assert "exceeds the KV capacity" in res.requests[0].reason
    assert res.summary["reject_reasons"] and res.summary["rejected"] == 1


def test_afd_single_request_matches_step_model(cost):
    n_in, n_out, M, N, m = 4096, 6, 2, 1, 3
    dep = sim.AFDisaggregated(1, 1, link_bw=32 * 50e9, num_attention=M, num_ffn=N, microbatches=m)
    r = sim.simulate_serving(dep, cost, [one(n_in, n_out)]).requests[0]
    L = cost.num_layers
    x = cost.kv_transfer_time(n_in, dep.link_bw)
    t_pre = cost.prefill_step_time([(n_in, 0)])
    exposed = max(x / L, x - t_pre * (L - 1) / L)
    steps = 0.0
    for j in range(n_out - 1):    # one request: micro-batch of 1, FFN batch of 1
        t_a = cost.decode_attention_time([n_in + j]) / L
        t_f = cost.decode_ffn_time(1) / N / L
        t_c = cost.afd_exchange_bytes(N) / dep.link_bw
        steps += L * max(m * t_a, m * t_f, t_a + t_f + 2 * t_c)
    assert r.t_finish - r.t_first == pytest.approx(exposed + steps, rel=1e-9)


def test_afd_cycle_hides_exchange_at_the_analytic_bound():
    from pdjax.analysis.afd_bounds import afd_min_microbatches_int
    t_f = 1.0
    for t_c in (0.25, 0.5, 0.9):
        m = afd_min_microbatches_int(t_c, t_f)
        assert sim.afd_step.afd_layer_cycle(t_f, t_f, t_c, m) == pytest.approx(m * t_f)
        assert sim.afd_step.exchange_hidden(t_f, t_f, t_c, m)
        assert not sim.afd_step.exchange_hidden(t_f, t_f, t_c, m - 1)


def test_determinism_and_seed_sensitivity(cost):
    spec = dict(num_requests=300, rate=30.0, input={"kind": "lognormal", "mean": 2000, "cv": 1.0},
                output={"kind": "uniform", "low": 2, "high": 200}, system_prompts=4,
                system_prompt_len=512, turns={"kind": "uniform", "low": 1, "high": 3}, think_time=1.0)
    dep = sim.PDDisaggregated(2, 2, link_bw=32 * 50e9)
    cache = lambda: sim.PrefixCache(10_000, block_size=64)
    a = sim.simulate_serving(dep, cost, sim.sample_requests(sim.WorkloadSpec(seed=3, **spec)), prefix_cache=cache())
    b = sim.simulate_serving(dep, cost, sim.sample_requests(sim.WorkloadSpec(seed=3, **spec)), prefix_cache=cache())
    c = sim.simulate_serving(dep, cost, sim.sample_requests(sim.WorkloadSpec(seed=4, **spec)), prefix_cache=cache())
    assert a.summary == b.summary
    assert a.summary != c.summary
    assert a.summary["prefix_hit_rate"] > 0


def test_simulate_leaves_input_requests_untouched(cost):
    reqs = [one(100, 3)]
    sim.simulate_serving(sim.Colocated(1), cost, reqs)
    assert reqs[0].status is None


DEPLOYMENTS = st.sampled_from(["colocated", "pd", "afd", "pd_controller"])


@settings(max_examples=25, deadline=None)
@given(kind=DEPLOYMENTS, seed=st.integers(0, 10_000), n=st.integers(1, 60),
       cap=st.integers(300, 6000), horizon=st.one_of(st.none(), st.floats(0.05, 5.0)),
       max_wait=st.one_of(st.none(), st.floats(0.01, 1.0)), time_budget=st.booleans())
def test_no_request_is_ever_lost(cost, kind, seed, n, cap, horizon, max_wait, time_budget):
    reqs = sim.sample_requests(sim.WorkloadSpec(
        num_requests=n, rate=200.0, seed=seed, input={"kind": "uniform", "low": 1, "high": 3000},
        output={"kind": "uniform", "low": 1, "high": 400}, system_prompts=2, system_prompt_len=64,
        turns={"kind": "uniform", "low": 1, "high": 3}))
    tb = 0.03 if time_budget else None
    if kind == "colocated":
        dep = sim.Colocated(2, token_budget=512, time_budget=tb, kv_capacity=cap)
    elif kind == "pd":
        dep = sim.PDDisaggregated(2, 2, link_bw=1e9, kv_capacity=cap, time_budget=tb, dp_ranks=2)
    elif kind == "afd":
        dep = sim.AFDisaggregated(1, 1, link_bw=1e10, kv_capacity=cap, num_attention=2, num_ffn=1,
                                  microbatches=2, max_batch=3)
    else:
        dep = sim.PDDisaggregated(2, 2, link_bw=1e9, kv_capacity=cap,
                                  controller=sim.ControllerConfig(interval=0.05, cooldown=0.1))
    res = sim.simulate_serving(dep, cost, reqs, prefix_cache=sim.PrefixCache(200, 32), horizon=horizon,
                       max_wait=None if kind == "colocated" else max_wait,
                       slo=sim.SLO(ttft=1.0, tpot=0.05))
    s = res.summary
    assert s["finished"] + s["rejected"] == s["requests"] == n
    assert all(r.status in ("finished", "rejected") for r in res.requests)
    assert all(r.reason for r in res.requests if r.status == "rejected")
    assert sum(s["reject_reasons"].values()) == s["rejected"]
    for r in res.requests:
        if r.status == "finished":
            assert r.arrival <= r.t_first <= r.t_finish
            assert 0 <= r.cached < r.input_len


def test_roofline_cost_model_runs():
    from pdjax.analysis import costmodel
    cm = costmodel.RooflineCostModel(pdjax.configs.deepseek_v3(), pdjax.analysis.hardware("h800"),
                                     dtype_bytes=2, ep_size=32)
    sim.cost.check_cost_model(cm)
    n_in, n_out = 2048, 5
    r = sim.simulate_serving(sim.Colocated(1, token_budget=4096), cm, [one(n_in, n_out)]).requests[0]
    assert r.t_first == pytest.approx(cm.prefill_step_time([(n_in, 0)]), rel=1e-9)
    steps = sum(cm.decode_step_time([n_in + j]) for j in range(n_out - 1))
    assert r.t_finish - r.t_first == pytest.approx(steps, rel=1e-9)
    bw = 32 * 50e9
    r = sim.simulate_serving(sim.PDDisaggregated(1, 1, link_bw=bw, num_layers=61), cm,
                     [one(n_in, n_out)]).requests[0]
    x, t_pre, L = cm.kv_transfer_time(n_in, bw), cm.prefill_step_time([(n_in, 0)]), 61
    assert r.kv_wait == pytest.approx(max(x / L, x - t_pre * (L - 1) / L), rel=1e-9)
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=200, rate=20.0, input=1024, output=64, seed=0))
    res = sim.simulate_serving(sim.PDDisaggregated(2, 2, link_bw=bw), cm, reqs)
    assert res.summary["finished"] + res.summary["rejected"] == 200
    # AF-disaggregated decode runs on the roofline model's attention/FFN split too
    assert cm.decode_attention_time([n_in]) + cm.decode_ffn_time(1) == pytest.approx(cm.decode_step_time([n_in]))
    assert cm.afd_exchange_bytes(4) == cm.cfg.hidden_size * 2 * min(cm.cfg.num_experts_per_tok, 4)
    res = sim.simulate_serving(sim.AFDisaggregated(2, 2, link_bw=bw, num_attention=2, num_ffn=2), cm, reqs)
    assert res.summary["finished"] + res.summary["rejected"] == 200 and res.summary["finished"] > 0


class ProtocolOnly:
    """The cost model seen only through the four protocol methods (no fast paths)."""

    def __init__(self, inner):
        self.inner, self.cfg = inner, inner.cfg

    def prefill_step_time(self, chunks):
        return self.inner.prefill_step_time(chunks)

    def decode_step_time(self, kv_lens):
        return self.inner.decode_step_time(kv_lens)

    def kv_transfer_time(self, n, bw):
        return self.inner.kv_transfer_time(n, bw)

    def kv_bytes_per_token(self):
        return self.inner.kv_bytes_per_token()


@pytest.mark.parametrize("dep", [sim.Colocated(2, token_budget=1024),
                                 sim.PDDisaggregated(2, 2, link_bw=32 * 10e9, dp_ranks=2)])
def test_incremental_kv_totals_match_the_protocol_path(cost, dep):
    """The fast path (running KV totals kept incrementally) and the protocol path (explicit
    kv_lens lists every step) give the same schedule."""
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=120, rate=40.0, seed=5,
                                         input={"kind": "uniform", "low": 10, "high": 5000},
                                         output={"kind": "uniform", "low": 1, "high": 120}))
    a = sim.simulate_serving(dep, cost, reqs).requests
    b = sim.simulate_serving(dep, ProtocolOnly(cost), reqs).requests
    for x, y in zip(a, b):
        assert x.t_first == pytest.approx(y.t_first, rel=1e-9)
        assert x.t_finish == pytest.approx(y.t_finish, rel=1e-9)


def test_result_displays_its_summary(cost):
    """A notebook shows a simulation's scalar metrics as a table (and print() as text)."""
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=50, rate=5.0, input=200, output=8, seed=0))
    res = sim.simulate_serving(sim.Colocated(1, token_budget=4096), cost, reqs)
    rows = dict(res.table())
    scalar = {k for k, v in res.summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert scalar and scalar <= set(rows) and rows["events"] == f"{res.events:,}"
    assert all(k in res._repr_html_() for k in scalar) and str(res).count("\n") == len(res.table()) - 1


def test_bad_values_are_refused_not_coerced():
    """NaN think time, a fractional system-prompt count and a negative duration each name
    their argument (they behaved as 0, were accepted, or blamed the rate)."""
    import math

    import pdjax.schedules as ps
    from pdjax import analysis
    with pytest.raises(ValueError, match="think_time must be finite"):
        sim.WorkloadSpec(num_requests=4, rate=1.0, think_time=math.nan)
    with pytest.raises(TypeError, match="system_prompts must be an integer"):
        sim.WorkloadSpec(num_requests=4, rate=1.0, system_prompts=1.5)
    with pytest.raises(ValueError, match="duration must be > 0, got -1"):
        sim.workload_at_rate(sim.WorkloadSpec(num_requests=4, rate=1.0), 5, duration=-1)
    with pytest.raises(TypeError, match="F must be a number"):
        ps.simulate(ps.build("1f1b", 2, 4), F="2")
    with pytest.raises(ValueError, match="link must be 'scale_up' or 'scale_out', got 'nvlink'"):
        analysis.report(pdjax.configs.deepseek_v3(), "h800", link="nvlink")
