"""The serving-simulator experiments: each runner on a small workload writes its table,
plots and report, and its typed config checks values before any simulation."""

import os

import pytest

from pdjax.experiments import sim_pd_vs_colocated, prefix_cache_capacity, results, runner, serving

SMALL = {
    "model": {"preset": "deepseek_v3"},
    "hardware": {"name": "h800", "dtype": "bf16", "ep_size": 32},
    "workload": {"num_requests": 150, "rate": 20.0, "seed": 0, "input": 2048, "output": 32},
    "slo": {"ttft": 2.0, "tpot": 0.05, "target": 0.9},
    "search": {"lo": 5.0, "hi": 10.0},
}


@pytest.mark.parametrize("kind,extra", [
    ("sim_pd_vs_colocated", {"deployment": {"instances": 2, "prefill": 1}, "sweep": {"rates": [10, 20]}}),
    ("pd_ratio_sweep", {"sweep": {"instances": 3, "prefill": [1, 2]}}),
    ("afd_ratio_sweep", {"sweep": {"pairs": [[2, 1]], "prefill": 2, "microbatches": 2}}),
    ("link_bandwidth", {"sweep": {"instances": 2, "prefill": 1, "link_gbps_per_gpu": [1, 50]}}),
    ("prefix_cache_capacity", {"sweep": {"instances": 2, "prefill": 1, "capacity_tokens": [0, 100_000]},
                               "workload": {"num_requests": 150, "rate": 20.0, "input": 512, "output": 16,
                                            "system_prompts": 2, "system_prompt_len": 1024}}),
])
def test_experiment_runners_write_their_outputs(tmp_path, kind, extra):
    cfg = {"kind": kind, "name": kind, **SMALL, **extra}
    if kind == "prefix_cache_capacity":
        cfg.pop("search")                                   # it searches no rate
    result = runner.EXPERIMENTS[kind].runner(runner.resolve(cfg), str(tmp_path))
    assert isinstance(result.headline, str) and result.headline and result.metrics["rows"]
    results.write(result, str(tmp_path))
    names = set(os.listdir(tmp_path))
    assert {"report.md", "metrics.json", f"{kind}.csv", f"{kind}.png", f"{kind}.svg"} <= names


@pytest.mark.parametrize("change, message", [
    ({"sweep": {"instances": 2, "prefill": 2}}, "sweep.prefill: must leave at least one decode instance"),
    ({"slo": {"ttft": 2.0}}, "slo.tpot: missing"),
    ({"hardware": {"name": "h900"}}, "hardware.name: unknown hardware"),
    ({"workload": {"num_requests": 10, "rate": 1.0, "output": {"kind": "normal"}}}, "workload.output: unknown length"),
    ({"pd": {"token_budget": "big"}}, "pd: PDDisaggregated.token_budget"),
])
def test_serving_configs_are_checked_before_simulating(tmp_path, monkeypatch, change, message):
    for module in (sim_pd_vs_colocated, prefix_cache_capacity):
        monkeypatch.setattr(module, "simulate_serving", lambda *a, **k: pytest.fail("simulated a bad config"))
    monkeypatch.setattr(serving, "max_rate_under_slo", lambda *a, **k: pytest.fail("simulated a bad config"))
    cfg = {**SMALL, "deployment": {"instances": 2, "prefill": 1}, **change}
    kind = "sim_pd_vs_colocated"
    if "sweep" in change:
        cfg.pop("deployment")
        kind = "link_bandwidth"
    with pytest.raises(ValueError, match=message):
        runner.EXPERIMENTS[kind].runner(runner.resolve({"kind": kind, **cfg}), str(tmp_path))
