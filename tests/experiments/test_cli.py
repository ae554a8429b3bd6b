"""The pdjax command line and its run directories: typed config errors that name the key,
--set overrides in config.json, the files of a run and the links of its report, report
rebuilds, reproducible metrics, the scale knob and --quiet."""

import csv
import glob
import json
import os
import re
import tomllib

import pytest

from pdjax.experiments import cli, sim_pd_vs_colocated, runner, serving

TOMLS = sorted(str(p) for p in runner.shipped_configs().iterdir() if p.name.endswith(".toml"))

TINY_SIM = """kind = "sim_pd_vs_colocated"
name = "tiny_sim"
[hardware]
ep_size = 32
[workload]
num_requests = 60
rate = 10.0
seed = 0
input = { kind = "lognormal", mean = 1024, cv = 1.0, high = 4096 }
output = 16
[slo]
ttft = 2.0
tpot = 0.05
[deployment]
instances = 2
prefill = 1
[sweep]
rates = [5, 10]
[search]
lo = 5.0
hi = 10.0
"""
TINY_BUBBLES = ('kind = "bubble_sweep"\nname = "tiny_bubbles"\n[sweep]\nschedules = ["1f1b", "dualpipe"]\n'
                'num_stages = [4]\nmicrobatch_multipliers = [2]\n')
TINY_DBO = 'kind = "dbo_sweep"\nname = "tiny_dbo"\n[sweep]\nratios = [0.5, 1.0]\nattn_shares = [0.5]\nnum_layers = 2\n'


@pytest.fixture
def tiny_sim(tmp_path):
    path = tmp_path / "tiny_sim.toml"
    path.write_text(TINY_SIM)
    return str(path)


def run_cli(config, runs, *args) -> str:
    """``pdjax run`` (quiet); the new run directory."""
    before = set(glob.glob(os.path.join(runs, "*", "*")))
    assert cli.main(["run", str(config), "--runs-dir", str(runs), "--quiet", *args]) == 0
    (new,) = set(glob.glob(os.path.join(runs, "*", "*"))) - before
    return new


def reproducible_part(run_dir) -> dict:
    """metrics.json without its wall-clock measurements, and the tables not marked measured."""
    with open(os.path.join(run_dir, "metrics.json")) as f:
        saved = json.load(f)
    saved.pop("wall_clock")
    tables = {name: open(os.path.join(run_dir, t["csv"])).read()
              for name, t in saved["tables"].items() if not t["wall_clock"]}
    return {"metrics.json": saved, "tables": tables}


def links(report: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", report)


# ---- 1. config errors name the key, before anything runs -----------------------------------
@pytest.mark.parametrize("config, override, message", [
    ("pd_ratio_sweep", 'sweep.instances="16"', "sweep.instances: expected int, got str"),
    ("sim_pd_vs_colocated", "deployment.num_prefill=2", "deployment.num_prefill: unknown key"),
    ("prefix_cache_capacity", "workload.rate=true", "workload.rate: expected float, got bool"),
    ("afd_ratio_sweep", 'sweep.pairs=[[3, "1"]]', "sweep.pairs[0][1]: expected int, got str"),
    ("link_bandwidth", "search.lo=0", "search.lo: must be > 0, got 0.0"),
    ("bubble_sweep", 'sweep.schedules=["1f2b"]', "sweep.schedules: must be one of"),
    ("dbo_sweep", 'sweep.ratios=[1, "x"]', "sweep.ratios[1]: expected float, got str"),
    ("quickstart", "stall.long_prompt=1.5", "stall.long_prompt: expected int, got float"),
    ("pd_vs_colocated", "engine.chunk=1", "engine.chunk: unknown key"),
    ("executed_bubbles", 'batch.rows="4"', "batch.rows: expected int, got str"),
    ("quickstart", "scale=0", "scale: must be >= 1, got 0"),
    ("quickstart", "extra=1", "extra: unknown key"),
    ("quickstart", 'model.compute_dtype="bf17"', "model.compute_dtype: ModelConfig.compute_dtype"),
])
def test_config_errors_name_the_key(tmp_path, capsys, config, override, message):
    runs = tmp_path / "runs"
    assert cli.main(["run", config, "--runs-dir", str(runs), "--set", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not runs.exists()                                   # raised before anything ran


@pytest.mark.parametrize("path", TOMLS, ids=os.path.basename)
def test_every_experiment_rejects_unknown_keys_and_wrong_types(path):
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    sec, keys = next((k, v) for k, v in raw.items() if isinstance(v, dict))
    with pytest.raises(ValueError, match=rf"{sec}\.not_a_key: unknown key"):
        runner.load_config(path, [f"{sec}.not_a_key=1"])
    key = next(k for k, v in keys.items() if isinstance(v, (bool, int, float, str)))
    with pytest.raises(ValueError, match=rf"{sec}\.{key}: expected .*, got table"):
        runner.load_config(path, [f"{sec}.{key}={{x = 1}}"])


# ---- 2. --set lands in the resolved config ------------------------------------------------
def test_set_overrides_land_in_config_json(tmp_path, tiny_sim):
    sets = ["sweep.rates=[4, 8]", "workload.seed=3", "scale=2", "slo.target=0.8"]
    run_dir = run_cli(tiny_sim, tmp_path / "runs", *[a for s in sets for a in ("--set", s)])
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["overrides"] == sets
    c = saved["config"]
    assert (c["sweep"]["rates"], c["workload"]["seed"], c["scale"], c["slo"]["target"]) == ([4.0, 8.0], 3, 2, 0.8)
    assert c["search"]["duration"] is None and c["hardware"]["cost"] == "linear"      # defaults filled in
    with open(os.path.join(run_dir, "sim_pd_vs_colocated.csv")) as f:
        assert {float(r["rate"]) for r in csv.DictReader(f)} == {4.0, 8.0}             # and they ran


# ---- 3. the files of a run ----------------------------------------------------------------
@pytest.mark.parametrize("text, table", [(TINY_SIM, "sim_pd_vs_colocated"), (TINY_BUBBLES, "bubble_sweep"),
                                         (TINY_DBO, "dbo_gain")], ids=["sim", "bubble_sweep", "dbo_sweep"])
def test_run_directory_holds_config_metrics_tables_plots_and_a_linked_report(tmp_path, text, table):
    path = tmp_path / "c.toml"
    path.write_text(text)
    run_dir = run_cli(path, tmp_path / "runs")
    assert os.path.relpath(run_dir, tmp_path / "runs").count(os.sep) == 1       # runs/<name>/<timestamp>
    names = set(os.listdir(run_dir))
    assert {"config.json", "metrics.json", f"{table}.csv", f"{table}.png", f"{table}.svg", "report.md"} <= names
    with open(os.path.join(run_dir, f"{table}.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(run_dir, f"{table}.svg")) as f:
        assert "<svg" in f.read()
    saved = json.load(open(os.path.join(run_dir, "metrics.json")))
    assert saved["metrics"] and saved["wall_clock"] == {} and saved["tables"][table]["rows"] > 0
    report = open(os.path.join(run_dir, "report.md")).read()
    targets = links(report)
    assert {f"{table}.png", f"{table}.svg", f"{table}.csv", "config.json", "metrics.json"} <= set(targets)
    for target in targets:
        assert os.path.isfile(os.path.join(run_dir, target)), target


# ---- 4. pdjax report rebuilds the report from the saved files -----------------------------
def test_report_rebuilds_identically_without_recomputing(tmp_path, tiny_sim, monkeypatch, capsys):
    run_dir = run_cli(tiny_sim, tmp_path / "runs")
    report = os.path.join(run_dir, "report.md")
    written = open(report).read()
    os.remove(report)

    def no_compute(*args, **kwargs):
        raise AssertionError("pdjax report recomputed the experiment")
    monkeypatch.setattr(sim_pd_vs_colocated, "simulate_serving", no_compute)
    monkeypatch.setattr(serving, "max_rate_under_slo", no_compute)
    assert cli.main(["report", run_dir]) == 0
    assert open(report).read() == written
    assert cli.main(["report", str(tmp_path)]) == 2                     # not a run directory
    assert "metrics.json" in capsys.readouterr().err


# ---- reproducibility ----------------------------------------------------------------------
def test_same_config_and_seed_reproduce_the_metrics(tmp_path, tiny_sim):
    runs = tmp_path / "runs"
    first, second = run_cli(tiny_sim, runs), run_cli(tiny_sim, runs)
    other_seed = run_cli(tiny_sim, runs, "--set", "workload.seed=1")
    assert first != second
    assert reproducible_part(first) == reproducible_part(second)
    assert reproducible_part(first) != reproducible_part(other_seed)        # the comparison can fail


# ---- 5. the scale knob --------------------------------------------------------------------
@pytest.mark.parametrize("path", TOMLS, ids=os.path.basename)
def test_every_experiment_has_a_documented_scale_knob(path):
    lines = open(path).read().splitlines()
    first_table = next(i for i, line in enumerate(lines) if line.startswith("["))
    (at,) = [i for i, line in enumerate(lines) if re.match(r"scale\s*=", line)]
    assert at < first_table and lines[at - 1].startswith("#")           # top-level, with its comment
    assert runner.load_config(path).scale == 1
    assert runner.load_config(path, ["scale=4"]).scale == 4


def test_scale_multiplies_the_work(tmp_path, tiny_sim):
    for text, check in ((TINY_DBO, lambda m: m["num_layers"] == 4),
                        (TINY_BUBBLES, lambda m: m["best_at_largest_m"].keys() == {"8"})):
        path = tmp_path / "c.toml"
        path.write_text(text)
        run_dir = run_cli(path, tmp_path / "runs", "--set", "scale=2")
        assert check(json.load(open(os.path.join(run_dir, "metrics.json")))["metrics"])
    c = serving.scaled(runner.load_config(tiny_sim, ["scale=3", "search.duration=2.0"]))
    assert (c.workload.num_requests, c.search.duration) == (180, 6.0)


# ---- 6. --quiet ---------------------------------------------------------------------------
def test_progress_goes_to_stderr_and_quiet_silences_it(tmp_path, tiny_sim, capsys):
    runs = str(tmp_path / "runs")
    assert cli.main(["run", tiny_sim, "--runs-dir", runs]) == 0
    out, err = capsys.readouterr()
    assert "sim_pd_vs_colocated: rates" in err and "highest rate" in out and "sim_pd_vs_colocated: rates" not in out
    assert cli.main(["run", tiny_sim, "--runs-dir", runs, "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("\n") == 1 and out.startswith("report: ")
    for run_dir in glob.glob(os.path.join(runs, "*", "*")):                # never into results
        for name in os.listdir(run_dir):
            if name.endswith((".md", ".json", ".csv")):
                assert "sim_pd_vs_colocated: rates" not in open(os.path.join(run_dir, name)).read()
