"""A run's life: every check a config can fail (types, ranges, finiteness, presets, schedule
names and sizes, device counts) runs before the run directory exists; a run that fails after
that leaves its directory marked FAILED, and ``pdjax report`` says so; the experiments ship
with pdjax and run by name from any directory; ``pdjax run <a directory>`` is a one-line
error."""

import glob
import json
import os
import tomllib

import pytest

from pdjax.experiments import bubble_sweep, cli, rundir, runner
from pdjax.experiments.results import Result

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SMALL_SWEEP = ["--set", "sweep.num_stages=[4]", "--set", "sweep.microbatch_multipliers=[2]",
               "--set", 'sweep.schedules=["1f1b"]']


# ---- every check before the run directory ---------------------------------------------------
@pytest.mark.parametrize("kind, overrides, message", [
    ("bubble_sweep", ["costs.F=nan"], "costs.F: must be a finite number, got nan"),
    ("link_bandwidth", ["slo.ttft=inf"], "slo.ttft: must be a finite number, got inf"),
    ("sim_pd_vs_colocated", ['workload.input={kind = "lognormal", mean = nan}'],
     "workload.input.mean: must be a finite number, got nan"),
    ("dbo_sweep", ["sweep.attn_shares=[1.5]"], "sweep.attn_shares: each must lie in [0, 1]"),
    ("executed_bubbles", ["run.microbatches=3"], "run.schedules: dualpipe at ranks = 2, microbatches = 3"),
    ("executed_bubbles", ['model.preset="huge"'], "model.preset: must be one of"),
    ("executed_bubbles", ["run.cluster=false", "run.ranks=16", "run.microbatches=32", 'run.schedules=["1f1b"]'],
     "executed_bubbles needs 16 devices, got 8"),
    ("pd_vs_colocated", ["engine.max_decode_slots=10"], "engine.max_decode_slots: x scale (10 x 1) must divide"),
    ("pd_vs_colocated", ["engine.max_context=512"], "engine.max_context: x scale (512) must hold a long request"),
    ("afd_ratio", ["measured.slots=20", "measured.new_tokens=30"], "measured.slots: x scale (20) must be a multiple"),
    ("afd_ratio", ["measured.ffn=3"], "measured.ffn: the tiny model's 8 routed experts do not divide over 3"),
    ("schedule_search", ['search.families=["dualpipe"]', "search.num_microbatches=31"],
     "search.num_microbatches: the dualpipe family alone needs an even number"),
    ("quickstart", ["executed.microbatches=3"], "executed: as a executed_bubbles run, run.schedules: dualpipe"),
    ("quickstart", ['analysis.hardware="h900"'], "analysis.hardware: unknown hardware"),
    ("mtp_speculative", ["decode.prompt=512", "decode.new_tokens=512"],
     "decode.prompt: prompt (512) + new_tokens (512) + 2 exceeds the model's max_position_embeddings (1024)"),
])
def test_every_check_runs_before_the_run_directory(tmp_path, capsys, monkeypatch, kind, overrides, message):
    module = runner.EXPERIMENTS[kind].module
    monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail("ran a bad config"))
    runs = tmp_path / "runs"
    args = [a for o in overrides for a in ("--set", o)]
    assert cli.main(["run", kind, "--runs-dir", str(runs), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not runs.exists()


# ---- a run that fails later is marked FAILED ------------------------------------------------
class _Unsaveable:
    def savefig(self, *args, **kwargs):
        raise OSError("disk full")


def _fails_in_the_experiment(config, out_dir):
    with open(os.path.join(out_dir, "bubble_sweep.csv"), "w") as f:
        f.write("schedule,P\n1f1b,")                                # half a table
    raise RuntimeError("boom")


def _fails_writing_the_results(config, out_dir):
    return Result("t", "h", tables={"t": [{"a": 1}]}, figures={"f": _Unsaveable()})


@pytest.mark.parametrize("fail, error", [(_fails_in_the_experiment, "RuntimeError: boom"),
                                         (_fails_writing_the_results, "OSError: disk full")],
                         ids=["in the experiment", "writing the results"])
def test_a_run_that_fails_is_marked_failed_and_report_says_so(tmp_path, capsys, monkeypatch, fail, error):
    monkeypatch.setattr(bubble_sweep, "run", fail)
    runs = tmp_path / "runs"
    assert cli.main(["run", "bubble_sweep", "--runs-dir", str(runs), "--quiet", *SMALL_SWEEP]) == 1
    err = capsys.readouterr().err
    assert f"the run failed ({error})" in err and "Traceback" not in err and err.count("\n") == 1
    (run_dir,) = glob.glob(str(runs / "bubble_sweep" / "*"))
    names = set(os.listdir(run_dir))
    assert rundir.FAILED in names and rundir.RUNNING not in names
    assert "metrics.json" not in names and "report.md" not in names
    marker = open(os.path.join(run_dir, rundir.FAILED)).read()
    assert marker.startswith(error) and "Traceback" in marker
    assert json.load(open(os.path.join(run_dir, "config.json")))["config"]["kind"] == "bubble_sweep"
    assert cli.main(["report", run_dir]) == 1
    err = capsys.readouterr().err
    assert f"the run failed ({error})" in err and "Traceback" not in err
    assert not os.path.exists(os.path.join(run_dir, "report.md"))
    with pytest.raises(rundir.RunFailed) as info:                  # Python callers: the error as the cause
        runner.run("bubble_sweep", runs_dir=str(runs), overrides=[a for a in SMALL_SWEEP if a != "--set"])
    assert error.split(":")[0] == type(info.value.__cause__).__name__
    assert os.path.exists(os.path.join(info.value.run_dir, rundir.FAILED))


def test_a_run_is_marked_running_until_it_is_complete(tmp_path, capsys, monkeypatch):
    seen = []
    real = bubble_sweep.run

    def watched(config, out_dir):
        seen.append(sorted(os.listdir(out_dir)))
        return real(config, out_dir)
    monkeypatch.setattr(bubble_sweep, "run", watched)
    runs = tmp_path / "runs"
    assert cli.main(["run", "bubble_sweep", "--runs-dir", str(runs), "--quiet", *SMALL_SWEEP]) == 0
    assert seen == [["RUNNING", "config.json"]]
    (run_dir,) = glob.glob(str(runs / "bubble_sweep" / "*"))
    names = set(os.listdir(run_dir))
    assert {"metrics.json", "report.md"} <= names and not names & {rundir.RUNNING, rundir.FAILED}
    assert "RUNNING" not in open(os.path.join(run_dir, "report.md")).read()
    # a process killed mid-run leaves RUNNING behind: report says the run did not finish
    open(os.path.join(run_dir, rundir.RUNNING), "w").write("pid 1\n")
    capsys.readouterr()
    assert cli.main(["report", run_dir]) == 1
    assert "the run has not finished" in capsys.readouterr().err


def test_ctrl_c_ends_a_run_with_one_line_and_marks_it_failed(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of a run: exit code 130, one line on stderr (no traceback), and
    the run directory is marked FAILED with the KeyboardInterrupt (not left RUNNING)."""
    def interrupted(config, out_dir):
        raise KeyboardInterrupt
    monkeypatch.setattr(bubble_sweep, "run", interrupted)
    runs = tmp_path / "runs"
    assert cli.main(["run", "bubble_sweep", "--runs-dir", str(runs), "--quiet", *SMALL_SWEEP]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["pdjax: interrupted (Ctrl-C)"], err
    (run_dir,) = glob.glob(str(runs / "bubble_sweep" / "*"))
    names = set(os.listdir(run_dir))
    assert rundir.FAILED in names and rundir.RUNNING not in names
    assert "KeyboardInterrupt" in open(os.path.join(run_dir, rundir.FAILED)).read()


# ---- the experiments ship with pdjax; run by name from anywhere ----------------------------
def test_run_and_list_by_name_from_another_directory(tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]     # under the header
    assert listed == sorted(runner.EXPERIMENTS)
    assert cli.main(["run", "bubble_sweep", "--quiet", *SMALL_SWEEP]) == 0
    (run_dir,) = glob.glob(str(elsewhere / "runs" / "bubble_sweep" / "*"))
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    assert saved["source"] == "bubble_sweep" and saved["config"]["sweep"]["schedules"] == ["1f1b"]
    assert "`pdjax run bubble_sweep --set 'sweep.num_stages=[4]'" in open(os.path.join(run_dir, "report.md")).read()


def test_run_of_a_directory_or_an_unknown_name_is_a_one_line_error(tmp_path, capsys):
    for target, message in ((str(tmp_path), "is a directory, not an experiment config"),
                            ("no_such_experiment", "no experiment config at no_such_experiment")):
        assert cli.main(["run", target, "--runs-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_the_configs_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    assert "configs/*.toml" in data["pdjax.experiments"]
    shipped = runner.shipped_configs()
    assert shipped.is_dir() and "experiments" not in os.listdir(ROOT)          # no second copy at the root
    assert sorted(p.name for p in shipped.iterdir()) == sorted(f"{k}.toml" for k in runner.EXPERIMENTS)
