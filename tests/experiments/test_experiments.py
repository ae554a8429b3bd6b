"""The pdjax run runner: the quick start end to end on a small workload, and bad configs."""

import json
import os
import re

import pytest

import pdjax
from pdjax import analysis

from pdjax.experiments import cli, runner


def test_quickstart_runs_and_writes_report(tmp_path):
    src = runner.shipped_configs().joinpath("quickstart.toml").read_text()
    small = src.replace("batch = 4", "batch = 2").replace("prompt_len = 32", "prompt_len = 8") \
               .replace("max_new_tokens = 16", "max_new_tokens = 4") \
               .replace("long_requests = 2", "long_requests = 0") \
               .replace('schedules = ["zb1p", "dualpipe"]', 'schedules = ["1f1b"]') \
               .replace("seq_len = 16", "seq_len = 8")      # pd_vs_colocated, executed_bubbles: tested on their own
    cfg = tmp_path / "q.toml"
    cfg.write_text(small)
    out_dir, result = runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
    report = open(os.path.join(out_dir, "report.md")).read()
    assert "## Model: prefill and decode" in report and "## Pipeline schedules" in report
    m = result.metrics["model"]
    assert m["generate_agrees"] is True
    cfg = pdjax.configs.tiny()
    assert m["kv_bytes_per_token_mla"] == analysis.kv_bytes_per_token(cfg, 4, "mla") \
        == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert "## Analysis" in report
    pd = result.metrics["pd"]
    assert pd["identical_to_generate"] is True and pd["kv_bytes_sent"] == pd["kv_bytes_formula"]
    assert os.path.exists(os.path.join(out_dir, "dualpipe_8x20.png"))
    assert json.load(open(os.path.join(out_dir, "metrics.json")))["metrics"]["pipeline"]["dualpipe"]
    assert "## Executed pipeline" in report and "(executed_pipeline/1f1b.png)" in report
    assert os.path.exists(os.path.join(out_dir, "executed_pipeline", "1f1b.png"))
    assert set(result.wall_clock["model"]) == {"compile_s", "prefill_tok_s", "decode_tok_s", "decode_step_ms"}
    row = result.metrics["executed_pipeline"]["rows"][0]
    assert row["measured_peak_bytes"] == row["simulated_peak_bytes"]
    for target in re.findall(r"\]\(([^)\s]+)\)", report):            # every link resolves, sub-runs too
        assert os.path.isfile(os.path.join(out_dir, target)), target
    assert os.path.isfile(os.path.join(out_dir, "executed_pipeline", "1f1b.svg"))
    # the AFD sweep: the afd_ratio experiment's simulated rows, one per (context, ratio)
    from pdjax.experiments import afd_ratio
    d = afd_ratio.Sweep()
    afd = result.metrics["afd"]
    assert "## AF disaggregation" in report
    assert [(r["context"], r["M:N"]) for r in afd["rows"]] == [
        (ctx, f"{M}A{d.ffn}F") for ctx in d.contexts for M in d.attention]
    assert all(r["speedup"] > 0 for r in afd["rows"])


def test_bubble_sweep_through_the_cli(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text('kind = "bubble_sweep"\nname = "s"\n[sweep]\nschedules = ["1f1b", "dualpipe"]\n'
                   'num_stages = [4]\nmicrobatch_multipliers = [2]\n')
    assert cli.main(["run", str(cfg), "--runs-dir", str(tmp_path / "runs")]) == 0
    assert "bubble ratio" in capsys.readouterr().out


@pytest.mark.parametrize("text, match", [
    ('kind = "nope"', "kind"),
    ('kind = "quickstart"\nname = "a/b"', "name"),
    ('kind = "quickstart"\n[workload]\nbatch = 0', "batch"),
    ('kind = "quickstart"\n[workload]\nbatchsize = 2', "workload.batchsize: unknown key"),
    ('kind = = 1', "malformed"),
])
def test_bad_configs(tmp_path, text, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=match):
        runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))


def test_cli_reports_bad_config_without_traceback(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('kind = "nope"')
    assert cli.main(["run", str(cfg)]) == 2
    assert "kind" in capsys.readouterr().err


def test_dbo_sweep_experiment(tmp_path):
    cfg = tmp_path / "d.toml"
    cfg.write_text('kind = "dbo_sweep"\n[sweep]\nratios = [0.5, 1.0, 2.0]\nattn_shares = [0.5]\nnum_layers = 2\n')
    out_dir, result = runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
    gains = {r["comm_over_compute"]: r["gain"] for r in result.metrics["rows"]}
    assert gains[1.0] == max(gains.values()) and all(g > 1 for g in gains.values())
    assert os.path.exists(os.path.join(out_dir, "dbo_gain.png"))


def test_every_experiment_config_names_a_known_kind():
    names = sorted(p.name for p in runner.shipped_configs().iterdir() if p.name.endswith(".toml"))
    assert names == sorted(f"{kind}.toml" for kind in runner.EXPERIMENTS)       # one config per kind
    for kind in runner.EXPERIMENTS:
        cfg = runner.load_config(kind)
        assert cfg.kind == kind and cfg.name == kind, kind                       # file name == kind


def test_pd_vs_colocated_small(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('kind = "pd_vs_colocated"\n[workload]\nshort_requests = 4\nshort_new_tokens = 6\n'
                   'long_requests = 1\nlong_prompt = 40\nlong_first_arrival_s = 0.0\n'
                   '[engine]\nmax_decode_slots = 4\nmax_context = 64\nchunk_tokens = 16\n')
    out_dir, result = runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
    assert result.metrics["identical_tokens"] is True
    sent = result.metrics["kv_bytes_sent"]
    assert sent["colocated"] == 0 < sent["pd"]
    assert sent["colocated_chunked"] == 0      # the same tokens (identical_tokens)
    assert os.path.exists(os.path.join(out_dir, "itl_over_time.png"))
    saved = json.load(open(os.path.join(out_dir, "metrics.json")))     # latencies are marked as measured
    assert saved["wall_clock"]["pd"]["itl_p99_ms"] > 0 and "itl_p99_ms" not in json.dumps(saved["metrics"])
    assert saved["tables"]["engines"]["wall_clock"] and saved["tables"]["itl_series"]["wall_clock"]


def test_set_overrides_land_in_the_resolved_config(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text('kind = "bubble_sweep"\nname = "s"\n[sweep]\nschedules = ["1f1b"]\n'
                   'num_stages = [4]\nmicrobatch_multipliers = [2]\n')
    runs = tmp_path / "runs"
    assert cli.main(["run", str(cfg), "--runs-dir", str(runs), "--set", "sweep.num_stages=[2, 8]",
                     "--set", 'sweep.schedules=["zb1p"]', "--set", "costs.W=0.5"]) == 0
    (run_dir,) = (runs / "s").iterdir()
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["config"]["sweep"]["num_stages"] == [2, 8]
    assert resolved["config"]["sweep"]["schedules"] == ["zb1p"]
    assert resolved["config"]["costs"]["W"] == 0.5
    rows = (run_dir / "bubble_sweep.csv").read_text().splitlines()[1:]
    assert {r.split(",")[0] for r in rows} == {"zb1p"} and len(rows) == 2     # P = 2 and 8


@pytest.mark.parametrize("override, match", [
    ("workload.batchsize=2", r"workload\.batchsize: unknown key"),
    ('workload.batch="two"', r"workload\.batch: expected int, got str"),
    ("workload", "expected key=value"),
])
def test_bad_overrides_name_the_key(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        runner.run("quickstart", runs_dir=str(tmp_path / "runs"), overrides=[override])


def test_list_shows_every_experiment(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(runner.EXPERIMENTS) + 1          # a header line, then one line each
    assert any(line.startswith("executed_bubbles ") for line in out)


def test_deployment_validation_experiment(tmp_path):
    """The validation run writes its tables, the predicted-vs-published and breakdown plots, and
    with a trace (a synthetic one in train.json's format) the measured timeline beside the
    predicted chunk pair; a missing trace path is refused before anything runs."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "cutlass::device_kernel<dpsk::grouped_gemm::GemmKernel>",
         "pid": 0, "tid": 7, "ts": 0, "dur": 900, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "void dpsk::ep::internode::dispatch<false>(int4*)",
         "pid": 0, "tid": 27, "ts": 100, "dur": 700, "args": {"correlation": 2}}]}
    path = tmp_path / "train.json"
    path.write_text(json.dumps(trace))
    cfg = tmp_path / "v.toml"
    cfg.write_text(f'kind = "deployment_validation"\n[plots]\ntrace = "{path}"\n')
    out_dir, result = runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
    for name in ("validation.csv", "calibration.csv", "predicted_vs_published.png", "breakdown.png", "train_pair.png"):
        assert os.path.exists(os.path.join(out_dir, name)), name
    assert result["gated"] == sum(r["gate"] != "reported" for r in result.metrics["validation"])
    bad = tmp_path / "b.toml"
    bad.write_text('kind = "deployment_validation"\n[plots]\ntrace = "nowhere.json"\n')
    with pytest.raises(ValueError, match="plots.trace: no file 'nowhere.json'"):
        runner.run(str(bad), runs_dir=str(tmp_path / "runs"))
