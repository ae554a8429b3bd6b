"""pdjax run dsa_context_sweep on two contexts and a small budget: it writes its tables, V3.2's
decode batch is what its FP8 KV row and the memory the weights leave allow (derived here from
the config, not from the experiment's code), at 128K V3.2 decodes more tokens per GPU than V3,
its decisions are pd_ratio_sweep's and afd_ratio's on its own rows, and bad config values are
refused naming the key before anything runs."""

import csv
import os

import pytest

import pdjax
from pdjax.analysis import hardware, param_counts
from pdjax.experiments import afd_ratio, cli, dsa_context_sweep, pd_ratio_sweep, runner

SMALL = ["workload.contexts=[4096, 131072]", "workload.output=64", "pd.instances=4", "search.duration=1.0",
         "search.lifetimes=1.0", "search.min_requests=30", "af.attention_counts=[16, 64]"]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("dsa")
    out_dir, result = runner.run("dsa_context_sweep", runs_dir=str(runs), overrides=SMALL)
    return out_dir, result, runner.load_config("dsa_context_sweep", SMALL)


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_it_runs_and_writes_its_tables(small_run):
    out_dir, result, c = small_run
    names = set(os.listdir(out_dir))
    assert {"report.md", "metrics.json", "config.json", "dsa_context_sweep.csv", "dsa_models.csv",
            "dsa_pd_sweep.csv", "dsa_af.csv", "dsa_context_sweep.png"} <= names
    per_context = _read(os.path.join(out_dir, "dsa_context_sweep.csv"))
    assert [int(r["context"]) for r in per_context] == c.workload.contexts
    for col in ("P:D", "tok/s/GPU", "decode batch", "decode tok/s/GPU", "AF"):
        assert all(r[f"V3 {col}"] and r[f"V3.2 {col}"] for r in per_context), col
    assert len(_read(os.path.join(out_dir, "dsa_models.csv"))) == 2 * len(c.workload.contexts)
    assert "flips" in per_context[0] and result.headline.startswith("V3 P:D ")
    assert "| context | V3 P:D | V3.2 P:D |" in open(os.path.join(out_dir, "report.md")).read()


def test_v32_decode_batch_is_what_its_fp8_row_and_the_free_memory_allow(small_run):
    _, result, c = small_run
    cfg = pdjax.configs.deepseek_v32()
    L, C, R, Di = cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    # FlashMLA's FP8 row: C FP8 values, a float32 scale per 128 of them, R BF16 values; then the
    # indexer's key: Di FP8 values and a float32 scale per 128 (DeepSeek-V3.2-Exp's Indexer)
    kv_per_token = L * (C + 4 * (C // 128) + 2 * R + Di + 4 * (Di // 128))
    assert kv_per_token == 48_068
    weights = param_counts(cfg).total * {"fp8": 1, "bf16": 2}[c.hardware.dtype]
    free = int(c.hardware.ep_size * hardware(c.hardware.name).hbm_bytes - weights)
    rows = {r["context"]: r for r in result["rows"] if r["model"] == "V3.2"}
    assert sorted(rows) == sorted(c.workload.contexts)
    for ctx, r in rows.items():
        held = ctx + c.workload.output                   # a request reserves its whole context
        assert r["kv_bytes_per_token"] == kv_per_token
        assert r["decode_batch_kv"] == free // (kv_per_token * held), ctx
        assert 0 < r["decode_batch"] <= r["decode_batch_kv"]


def test_at_128k_v32_decodes_more_tokens_per_gpu_than_v3(small_run):
    _, result, _ = small_run
    at = {r["model"]: r for r in result["rows"] if r["context"] == 131072}
    assert at["V3.2"]["decode_tok_s_per_gpu"] > at["V3"]["decode_tok_s_per_gpu"] > 0
    assert at["V3.2"]["decode_batch_kv"] > at["V3"]["decode_batch_kv"]      # the smaller row holds more requests
    assert at["V3.2"]["decode_step_ms"] < at["V3"]["decode_step_ms"]        # and reads 2,048 keys, not 131K


def test_the_decisions_are_pd_ratio_sweeps_and_afd_ratios(small_run):
    out_dir, result, c = small_run
    for r in result["rows"]:
        pd = [s for s in result.tables["dsa_pd_sweep"] if s["model"] == r["model"] and s["context"] == r["context"]]
        assert pd and pd_ratio_sweep.best_split(pd)["label"] == r["best_pd"]
        af = [a for a in result.tables["dsa_af"]
              if a["model"] == r["model"] and a["context"] == r["context"] + c.workload.output]
        best = afd_ratio.best_ratio(af)
        assert best["label"] == r["af_best"]
        assert r["af_choice"] == (best["label"] if best["speedup"] > 1 else "plain decode")
    assert dsa_context_sweep.analytic_split(16, 1.0, 3.0) == 12       # min(12, 12): balanced
    assert dsa_context_sweep.analytic_split(4, 1.0, 100.0) == 3       # decode never binds


@pytest.mark.parametrize("overrides, message", [
    (['v32.kv_layout="fp4"'], "v32.kv_layout: must be one of uniform, deepseek-fp8"),
    (['v3.preset="deepseek_v4"'], "v3.preset: must be one of"),
    (["workload.contexts=[4096, 0]"], "workload.contexts: must be >= 1"),
    (["workload.contexts=[200000]"], "workload.contexts: 200256 tokens with the output exceed"),
    (["hardware.ep_size=4"], "hardware.ep_size: 4 x h200 do not hold deepseek_v3's fp8 weights"),
    (['hardware.name="h900"'], "hardware.name: unknown hardware"),
    (["pd.prefill=[16]"], "pd.prefill: must leave at least one decode instance"),
    (["search.hi=0.4"], "search.hi: must exceed lo"),
    (['af.ffn="h900"'], "af.ffn: unknown hardware"),
    (['af.attention="a100"'], "af.attention: hardware 'a100' has no peak_fp8_flops figure"),
    (["slo.target=1.5"], "slo.target: must lie in (0, 1]"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.setattr(dsa_context_sweep, "run", lambda *a, **k: pytest.fail("ran a bad config"))
    runs = tmp_path / "runs"
    assert cli.main(["run", "dsa_context_sweep", "--runs-dir", str(runs), *[a for o in overrides
                                                                              for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not runs.exists()
