"""pdjax run mtp_speculative on a tiny model trained for a few steps (the pipeline, not the
quality; enough that its drafts are accepted, so the accept rate shows in the formula): it writes its tables, its simulated speed-up is the cost model's MTP term of the
measured accept rate and calibrated step cost, and bad config values are refused before
anything runs."""

import csv
import json
import os

import pytest

from pdjax.experiments import mtp_train, runner

TINY = """kind = "mtp_speculative"
[train]
width = 16
layers = 1
steps = 30
batch = 8
seq = 16
lr = 0.02
warmup = 0
corpus_mb = 0.02
holdout = 0.2
cache = "{cache}"
[decode]
batches = [1, 2]
prompt = 8
new_tokens = 64
repeats = 2
[simulate]
inner = 2
repeats = 1
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp")
    cfg = tmp / "tiny.toml"
    cfg.write_text(TINY.format(cache=tmp / "params.npz"))
    out_dir, result = runner.run(str(cfg), runs_dir=str(tmp / "runs"))
    return out_dir, result, runner.load_config(str(cfg))


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_run_writes_its_tables_and_caches_its_params(tiny_run):
    out_dir, result, config = tiny_run
    for name in ("metrics.json", "report.md", "speedup.csv", "steps.csv", "calibration.csv", "speedup.png"):
        assert os.path.exists(os.path.join(out_dir, name)), name
    speed = _csv(os.path.join(out_dir, "speedup.csv"))
    assert [int(r["batch"]) for r in speed] == [1, 2]
    saved = json.load(open(os.path.join(out_dir, "metrics.json")))
    assert saved["tables"]["speedup"]["wall_clock"] and "simulated" not in json.dumps(saved["metrics"])
    for row in saved["metrics"]["decode"]:                      # tokens per step: 1 + the accept rate
        assert 0 <= row["accept"] <= 1 and row["tok/step"] == pytest.approx(1 + row["accept"])
        assert 1 <= row["steps"] <= config.decode.new_tokens - 1   # the tokens after the prefill's first
    assert result.metrics["params_from"] == "trained"
    # the params went to the cache: the same settings load them again, other settings do not
    t = config.train
    data, _ = mtp_train.corpus(t.corpus_mb)
    cfg = mtp_train.model_config(t.width, t.layers)
    assert mtp_train.trained_params(cfg, t, data, t.cache)[2] == "cache"
    assert mtp_train.load(t.cache, cfg, mtp_train.settings(cfg, t, len(data) - 1)) is None


def test_simulated_speedup_is_the_mtp_term_of_the_measured_inputs(tiny_run):
    """(1 + a) t(B, B L) / (t(2B, 2B L) + (t(2B, 2B L) - d0) / layers), recomputed from the
    saved fit, accept rates, cache length and layer count."""
    out_dir, result, config = tiny_run
    saved = json.load(open(os.path.join(out_dir, "metrics.json")))
    fit, m = saved["wall_clock"]["fit"], saved["metrics"]
    d0, d1, d2, L, layers = fit["d0"], fit["d1"], fit["d2"], m["kv_len"], m["layers"]
    assert L == config.decode.prompt + config.decode.new_tokens and layers == 1
    steps = {int(r["batch"]): r for r in _csv(os.path.join(out_dir, "steps.csv"))}
    rows = _csv(os.path.join(out_dir, "speedup.csv"))
    assert any(float(r["accept"]) > 0 for r in rows)      # else the accept rate would not show below
    for row in rows:
        B, a = int(row["batch"]), float(row["accept"])
        plain = d0 + d1 * B + d2 * B * L
        rows_cost = 2 * d1 * B + 2 * d2 * B * L          # two tokens for each of B requests
        verify = d0 + rows_cost + rows_cost / layers       # + the draft depth: one layer of `layers`
        assert float(row["simulated"]) == pytest.approx((1 + a) * plain / verify, rel=1e-9)
        assert float(row["measured / simulated"]) == pytest.approx(
            float(row["speed-up"]) / float(row["simulated"]), rel=1e-9)
        assert float(steps[B]["model verify ms"]) == pytest.approx(1e3 * verify, rel=1e-9)


@pytest.mark.parametrize("override, match", [
    ("decode.batches=[0, 8]", r"decode\.batches: must be >= 1"),
    ("decode.batches=[8, 8]", r"decode\.batches: must be distinct"),
    ("decode.batches=[]", r"decode\.batches: must not be empty"),
    ("decode.new_tokens=1", r"decode\.new_tokens: must be >= 2"),
    ("decode.prompt=1000", r"max_position_embeddings"),
    ("train.width=24", r"train\.width: must be a multiple of 16"),
    ("train.holdout=1.0", r"train\.holdout: must be < 1"),
    ("train.corpus_mb=0.001", r"train\.holdout: the held-out bytes"),
    ('train.cache="params.bin"', r"train\.cache: must be an \.npz path"),
    ('simulate.calibration="fast"', r"simulate\.calibration: must be one of loop, call"),
    ("simulate.repeats=0", r"simulate\.repeats: must be >= 1"),
])
def test_bad_config_values_are_refused(override, match):
    with pytest.raises(ValueError, match=match):
        runner.load_config("mtp_speculative", [override])
