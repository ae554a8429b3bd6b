"""What the simulator needs to model pdjax's own engines: a cost model from fitted step
costs, colocated steps that alternate between a prefill chunk and a decode step (the
ColocatedEngine's FIFO pool lock), prefill steps of one request per call, and a scheduler
that is the decode loop (it looks at its queues between decode steps)."""

import math

import pytest

from pdjax import sim
from pdjax.analysis.costmodel_fit import DecodeCostFit, PrefillCostFit
from pdjax.sim.workload import SimRequest

P, D = 10.0, 1.0          # seconds: every prefill call, every decode step


def flat_cost(kv_bytes=4):
    return sim.FittedStepCost(prefill=lambda q, c: P, decode=lambda B, K: D, kv_bytes=kv_bytes)


def test_fitted_step_cost_pads_sums_chunks_and_decodes_by_totals():
    pre = PrefillCostFit(a=1e-6, b=2e-7, g=1e-4, r2=1.0, n=4, d=3e-3)
    dec = DecodeCostFit(d0=2e-3, d1=1e-5, d2=1e-8, r2=1.0, n=3)
    pad = lambda q: 1 << (q - 1).bit_length()                          # noqa: E731 - powers of two
    cost = sim.FittedStepCost(prefill=pre, decode=dec, kv_bytes=96, num_layers=3, prefill_rows=pad)
    sim.cost.check_cost_model(cost)
    assert cost.prefill_step_time([(100, 0)]) == pytest.approx(pre(128, 0))
    assert cost.prefill_step_time([(100, 0), (16, 64)]) == pytest.approx(pre(128, 0) + pre(16, 64))
    assert cost.prefill_step_time([]) == 0.0
    assert cost.decode_step_time([100, 200]) == pytest.approx(dec(2, 300))
    assert cost.decode_step_time([]) == 0.0
    assert cost.kv_transfer_time(1000, 96e3) == pytest.approx(1.0)
    assert cost.kv_bytes_per_token() == 96
    with pytest.raises(ValueError, match="kv_bytes"):
        sim.FittedStepCost(prefill=pre, decode=dec, kv_bytes=0)
    with pytest.raises(ValueError, match="callables"):
        sim.FittedStepCost(prefill=1.0, decode=dec, kv_bytes=1)


def test_alternate_steps_take_turns_and_itl_spans_the_prefill():
    """A (8 in, 4 out) at 0, B (8 in, 2 out) at 0.5: prefill A [0, 10]; decode [10, 11]
    (A joins); prefill B [11, 21] (steps alternate); decode [21, 22] (B joins, ends);
    decode [22, 23] (A ends). A's tokens at 10, 11, 22, 23."""
    reqs = [SimRequest(0, 0.0, 8, 4), SimRequest(1, 0.5, 8, 2)]
    dep = sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1)
    res = sim.simulate_serving(dep, flat_cost(), reqs)
    a, b = res.requests
    assert (a.t_first, a.t_finish) == (10.0, 23.0)
    assert (b.t_first, b.t_finish) == (21.0, 22.0)
    # ITL tokens: A 1, 11 (a prefill step between), 1; B 1
    s = res.summary
    assert s["itl_p50"] == 1.0 and s["util_colocated"] == pytest.approx(1.0)
    assert sorted(zip(*res_itl(dep, reqs))) == [(1.0, 1), (1.0, 1), (1.0, 1), (11.0, 1)]


def res_itl(dep, reqs):
    s = sim.Simulator(dep, flat_cost(), reqs)
    s.run()
    return s.itl_v, s.itl_w


def test_alternate_runs_prefills_back_to_back_when_nothing_decodes():
    """One-token requests: no decode step, the prefills follow each other. Two arriving
    while the first prefills: with one request per call their first tokens come a call
    apart; without the limit they share one step (two calls: 2 P)."""
    reqs = [SimRequest(0, 0.0, 8, 1), SimRequest(1, 1.0, 8, 1), SimRequest(2, 1.0, 8, 1)]
    dep = sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1)
    assert [r.t_first for r in sim.simulate_serving(dep, flat_cost(), reqs).requests] == [10.0, 20.0, 30.0]
    dep = sim.Colocated(1, token_budget=64, step_policy="alternate")
    assert [r.t_first for r in sim.simulate_serving(dep, flat_cost(), reqs).requests] == [10.0, 30.0, 30.0]
    # the decode slots bound admission: max_batch = 1 holds B until A ends
    reqs = [SimRequest(0, 0.0, 8, 3), SimRequest(1, 0.0, 8, 3)]
    a, b = sim.simulate_serving(sim.Colocated(1, token_budget=64, max_batch=1, step_policy="alternate",
                                      prefill_max_requests=1), flat_cost(), reqs).requests
    assert a.t_finish == P + 2 * D and b.t_first == a.t_finish + P


def test_pd_one_request_per_prefill_call():
    reqs = [SimRequest(0, 0.0, 8, 2), SimRequest(1, 1.0, 8, 2), SimRequest(2, 1.0, 8, 2)]
    one = sim.simulate_serving(sim.PDDisaggregated(1, 1, link_bw=1e12, prefill_max_requests=1), flat_cost(), reqs)
    assert [r.t_first for r in one.requests] == [10.0, 20.0, 30.0]
    batched = sim.simulate_serving(sim.PDDisaggregated(1, 1, link_bw=1e12), flat_cost(), reqs)
    assert [r.t_first for r in batched.requests] == [10.0, 30.0, 30.0]  # one step, two calls


def test_decode_loop_sees_queues_between_decode_steps():
    """A (8 in, 6 out) at 0, B (8 in, 2 out) at 11.5, while A decodes. Prefill A [0, 10]
    (idle loop: its token at once); decode [10, 11], [11, 12]; B arrives in the latter, is
    seen at 12, and the loop's own step [12, 13] goes first; prefill B [13, 23]; its first
    token at the end of the next decode step [23, 24]; the loop sees it at the end of
    [24, 25] (A's last token); B joins [25, 26]."""
    reqs = [SimRequest(0, 0.0, 8, 6), SimRequest(1, 11.5, 8, 2)]
    dep = sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1, decode_loop=True)
    s = sim.Simulator(dep, flat_cost(), reqs)
    res = s.run()
    a, b = res.requests
    assert (a.t_first, a.t_finish) == (10.0, 25.0)
    assert (b.t_prefill_start, b.t_first, b.t_finish) == (13.0, 24.0, 26.0)
    assert sorted(s.itl_v) == [1.0, 1.0, 1.0, 1.0, 2.0, 11.0]
    # the same without the loop: B's prefill starts when the step it arrived in ends
    plain = sim.simulate_serving(sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1),
                         flat_cost(), reqs).requests[1]
    assert (plain.t_prefill_start, plain.t_first) == (12.0, 22.0)


def test_pd_decode_loop_places_arrivals_when_the_step_ends():
    reqs = [SimRequest(0, 0.0, 8, 4), SimRequest(1, 10.5, 8, 2)]
    for loop, start in ((True, 11.0), (False, 10.5)):
        dep = sim.PDDisaggregated(1, 1, link_bw=1e12, prefill_max_requests=1, decode_loop=loop)
        a, b = sim.simulate_serving(dep, flat_cost(), reqs).requests
        assert a.t_finish == pytest.approx(13.0)                 # + a transfer of 3.2e-11 s
        assert b.t_handshake == pytest.approx(start) and b.t_first == pytest.approx(start + P)
    with pytest.raises(ValueError, match="num_decode=1"):
        sim.PDDisaggregated(1, 2, link_bw=1.0, decode_loop=True)
    with pytest.raises(ValueError, match="step_policy='alternate'"):
        sim.Colocated(1, decode_loop=True)


def test_handoff_overhead_of_a_decode_loop():
    """dj = 0.5 s per joining request, dl = 0.25 s per request that left at the step before.
    PD: request 0 (13 tokens) joins at 10 (step 1.5 s), steps 1 s each; request 1 (2 tokens)
    joins the step at 20.5 (1.5 s) and leaves: request 0's last step costs 1.25 s. A request
    that leaves before the loop idles costs nothing later."""
    dec = DecodeCostFit(d0=D, d1=0.0, d2=0.0, r2=1.0, n=5, dj=0.5, dl=0.25)
    cost = sim.FittedStepCost(prefill=lambda q, c: P, decode=dec, kv_bytes=1)
    assert cost.decode_overhead(2, 1) == 1.25 and flat_cost().decode_overhead(2, 1) == 0.0
    dep = sim.PDDisaggregated(1, 1, link_bw=1e15, prefill_max_requests=1)
    a, b = sim.simulate_serving(dep, cost, [SimRequest(0, 0.0, 8, 13), SimRequest(1, 0.0, 8, 2)]).requests
    assert (b.t_first, b.t_finish) == (pytest.approx(20.0), pytest.approx(22.0))
    assert a.t_finish == pytest.approx(10.0 + 1.5 + 10 * D + 0.5 + 1.25)
    a, b = sim.simulate_serving(dep, cost, [SimRequest(0, 0.0, 8, 2), SimRequest(1, 0.0, 8, 2)]).requests
    assert a.t_finish == pytest.approx(11.5) and b.t_finish == pytest.approx(21.5)
    # colocated (alternate): the loop's handoff work hides under a prefill step between
    dep = sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1)
    a, b = sim.simulate_serving(dep, cost, [SimRequest(0, 0.0, 8, 3), SimRequest(1, 1.0, 8, 2)]).requests
    # prefill 0 [0, 10]; decode [10, 11.5] (0 joins from idle); prefill 1 [11.5, 21.5];
    # decode [21.5, 22.5] (1 joins after a prefill step: no overhead) ends both
    assert (a.t_finish, b.t_first, b.t_finish) == (22.5, 21.5, 22.5)


def test_decode_jitter_scales_decode_steps_only_and_is_seeded():
    reqs = [SimRequest(0, 0.0, 8, 40), SimRequest(1, 0.5, 8, 30)]
    dep = sim.PDDisaggregated(1, 1, link_bw=1e15, prefill_max_requests=1)
    itl = lambda s: {round(v, 6) for v in s.itl_v}                          # noqa: E731 (+ ~1e-11 s transfers)
    base = sim.Simulator(dep, flat_cost(), reqs)
    base.run()
    assert itl(base) == {D, 2 * D}             # request 1's KV lands as a step starts: it waits one
    one = sim.Simulator(dep, flat_cost(), reqs, decode_jitter=[2.0])          # every step doubled
    res = one.run()
    assert itl(one) == {2 * D, 4 * D} and res.requests[1].t_first == 2 * P    # prefill untouched
    runs = []
    for _ in range(2):
        s = sim.Simulator(dep, flat_cost(), reqs, decode_jitter=[0.5, 1.0, 3.0], jitter_seed=7)
        s.run()
        runs.append(s.itl_v)
    assert runs[0] == runs[1] and {0.5, 1.0, 3.0} <= itl(s)
    col = sim.Colocated(1, token_budget=64, step_policy="alternate", prefill_max_requests=1)
    r = sim.simulate_serving(col, flat_cost(), reqs, decode_jitter=[2.0]).requests[0]
    assert r.t_first == P and r.t_finish > P + 2 * D * 39
    with pytest.raises(ValueError, match="decode_jitter"):
        sim.simulate_serving(dep, flat_cost(), reqs, decode_jitter=[1.0, 0.0])


def test_pd_contention_slows_a_step_that_starts_beside_the_other_pool():
    """A (8 in, 13 out) prefills [0, 10] alone, decodes from 10; B arrives at 12.5: its
    prefill starts beside a decode step (x 2: [12.5, 32.5]); A's steps starting while it
    runs take 3 s (x 3): [13, 16], ..., [31, 34]; then 1 s again."""
    reqs = [SimRequest(0, 0.0, 8, 13), SimRequest(1, 12.5, 8, 2)]
    dep = sim.PDDisaggregated(1, 1, link_bw=1e15, prefill_max_requests=1, contention=(2.0, 3.0))
    a, b = sim.simulate_serving(dep, flat_cost(), reqs).requests
    assert b.t_first == pytest.approx(12.5 + 2 * P)
    # A: steps end 11, 12, 13 (alone), then 7 steps of 3 s starting at 13..31 (B's prefill runs
    # until 32.5), then 1 s steps: 12 tokens after the first
    assert a.t_finish == pytest.approx(13 + 7 * 3 + 2 * D)
    for bad in ((0.5, 1.0), (1.0,), (1.0, float("nan"))):
        with pytest.raises(ValueError, match="contention"):
            sim.PDDisaggregated(1, 1, link_bw=1.0, contention=bad)


@pytest.mark.parametrize("kw", [dict(step_policy="both"), dict(prefill_max_requests=0)])
def test_colocated_policy_errors(kw):
    with pytest.raises(ValueError, match="Colocated"):
        sim.Colocated(1, **kw)
    if "prefill_max_requests" in kw:
        with pytest.raises(ValueError, match="prefill_max_requests"):
            sim.PDDisaggregated(1, 1, link_bw=1.0, **kw)


def test_alternate_conserves_requests_under_load():
    reqs = sim.sample_requests(sim.WorkloadSpec(num_requests=200, rate=0.08, seed=1,
                                         input={"kind": "list", "values": (8, 64)},
                                         output={"kind": "uniform", "low": 1, "high": 30}))
    for loop in (False, True):
        dep = sim.Colocated(1, token_budget=32, max_batch=4, step_policy="alternate", prefill_max_requests=1,
                            decode_loop=loop)
        res = sim.simulate_serving(dep, flat_cost(), reqs)
        s = res.summary
        assert s["finished"] == 200 and not math.isnan(s["itl_p90"]) and s["ttft_p50"] >= P
        for r in res.requests:                               # a 64-token prompt: two 32-token calls
            assert r.t_first - r.t_prefill_start >= P * math.ceil(r.input_len / 32) - 1e-9
