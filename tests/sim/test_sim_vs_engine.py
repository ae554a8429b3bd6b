"""The simulator held against the engines (pdjax.experiments.sim_vs_engine): the machinery
on a handful of requests. Structure and sanity only: the timing targets live in
benchmarks/sim_vs_engine.py (this machine is noisy)."""

import math

import jax
import pytest

from pdjax import sim
from pdjax.analysis.costmodel_fit import DecodeCostFit
from pdjax.experiments import sim_vs_engine as sve


def test_decode_samples_after_the_last_prefill():
    """Request 0 (4-token prompt) decodes alone at steps 1.0, 2.0; request 1 (10 tokens)
    gets its first token at 2.5 and joins the step ending at 3.0; both step at 4.0 and 5.5,
    where request 0 ends; request 1 steps alone at 6.0. Iterations after the last first
    token: (3.0, 4.0], (4.0, 5.5] and (5.5, 6.0] (request 0 left). K: prompt + tokens fed
    before the step (token j of a request read prompt + j - 1)."""
    reqs = [{"index": 0, "prompt_tokens": 4, "token_times": [0.5, 1.0, 2.0, 3.0, 4.0, 5.5]},
            {"index": 1, "prompt_tokens": 10, "token_times": [2.5, 3.0, 4.0, 5.5, 6.0]}]
    assert sve.decode_samples(reqs) == [(2, (4 + 3) + (10 + 1), 0, 0, 1.0), (2, (4 + 4) + (10 + 2), 0, 0, 1.5),
                                        (1, 10 + 3, 0, 1, 0.5)]
    cal = sve.DecodeCalibration(DecodeCostFit(0.5, 0.0, 0.0, 1.0, 5), (), tuple(sve.decode_samples(reqs)))
    assert cal.jitter == [2.0, 3.0]


def test_decode_contention_splits_by_prefill_in_flight():
    """Request 0 decodes steps of 1 s (ends 1..6); request 1 arrives at 2.5 and has its first
    token at 3.5 (a one-token request: it never joins). Iterations (2, 3] and (3, 4] overlap
    its prefill; the fit predicts 0.5 s: ratio 2 everywhere."""
    reqs = [{"index": 0, "prompt_tokens": 4, "token_times": [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "ttft": 0.5,
             "error": None},
            {"index": 1, "prompt_tokens": 8, "token_times": [3.5], "ttft": 1.0, "error": None}]
    fit = DecodeCostFit(0.5, 0.0, 0.0, 1.0, 3)
    assert sve.decode_contention({"requests": reqs}, fit) == {"prefill": 2.0, "no_prefill": 2.0, "n_prefill": 2,
                                                              "n_no_prefill": 3}


def test_make_trace_is_a_poisson_trace_of_the_mix():
    trace = sve.make_trace(50, 10.0, seed=3, prompt_lens=(16, 40), output_lens=(2, 6))
    assert len(trace) == 50 and trace[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(trace, trace[1:]))
    assert {r.input_len for r in trace} == {16, 40} and all(2 <= r.output_len <= 6 for r in trace)
    assert [r.arrival for r in trace] == [r.arrival for r in sve.make_trace(50, 10.0, seed=3, prompt_lens=(16, 40),
                                                                           output_lens=(2, 6))]


@pytest.mark.parametrize("kind", ["colocated"])     # "pd" runs the same machinery on a PDEngine (the benchmark)
def test_compare_engine_rows(tiny_cfg, tiny_params, kind):
    trace = sve.make_trace(6, 40.0, seed=0, prompt_lens=(16, 40), output_lens=(3, 8))
    setup = sve.EngineSetup(slots=4, max_context=64, devices=2)
    c = sve.compare_engine(kind, tiny_params, tiny_cfg, trace, setup=setup, decode_batches=(1, 2),
                           decode_tokens=8, prefill_repeats=1, probes=2, devices=jax.devices()[:4])
    assert [(r["engine"], r["metric"], r["pct"]) for r in c.rows] == [
        (kind, m, p) for m in ("ttft", "itl") for p in ("p50", "p90")]
    for r in c.rows:
        assert r["measured_s"] > 0, r
        for name in sve.PREDICTIONS:
            assert r[f"{name}_s"] > 0 and math.isfinite(r[f"{name}_err"]), r
    s = c.sims["model"].summary
    assert s["finished"] == len(trace) and c.stats["failed"] == 0
    assert set(c.sims) == set(c.costs) == set(sve.PREDICTIONS)
    assert all(sm.summary["finished"] == len(trace) for sm in c.sims.values())
    assert isinstance(c.costs["model"], sim.FittedStepCost) and c.decode.fit.n >= 5
    assert c.decode.iterations and c.decode.jitter and len(c.served.samples) == 2
    assert c.decode.result.spec.handoff and c.decode.result.samples == c.decode.samples
    assert c.served.prefill_factor >= 1 and c.served.decode_factor >= 1
    assert (c.sims["model"].summary.get("deployment"), kind) in (("colocated", "colocated"), ("pd", "pd"))
    for cost in c.costs.values():
        assert cost.prefill_step_time([(40, 0)]) >= cost.prefill_step_time([(16, 0)]) > 0
