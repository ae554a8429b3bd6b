"""Experiment checks and what the CLI and reports say: constraints between keys refused
before the run directory exists, `pdjax list`'s layout, progress text taken literally, the
bubble sweep's headline counting every row, and where executed ranks really ran."""

import io

import pytest

from pdjax.experiments import bubble_sweep, cli, executed_bubbles, progress, quickstart, results, runner
from pdjax.experiments.schema import parse


# ---- constraints between keys: refused before anything is written --------------------------
@pytest.mark.parametrize("overrides, named", [
    (["costs.W=3"], ("costs.W", "costs.B")),                               # W > B: I = B - W < 0
    (["costs.F=0", "costs.B=0", "costs.W=0"], ("costs.F", "costs.B")),     # no work: ratios divide by 0
])
def test_bubble_sweep_cost_relations_are_refused_before_the_run_directory(tmp_path, capsys, overrides, named):
    runs = tmp_path / "runs"
    sets = [arg for o in overrides for arg in ("--set", o)]
    assert cli.main(["run", "bubble_sweep", "--runs-dir", str(runs), "--quiet", *sets]) == 2
    err = capsys.readouterr().err
    assert all(key in err for key in named), err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not runs.exists()


def test_quickstart_ep_size_above_the_routed_experts_is_refused_before_the_run_directory(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli.main(["run", "quickstart", "--runs-dir", str(runs), "--quiet", "--set", "analysis.ep_size=1000"]) == 2
    err = capsys.readouterr().err
    assert "analysis.ep_size" in err and "1000" in err and "256" in err
    assert not runs.exists()


# ---- pdjax list ----------------------------------------------------------------------------
def test_list_has_a_header_and_names_each_experiment_once(capsys):
    assert cli.main(["list"]) == 0
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.split() == ["experiment", "description"]
    assert sorted(line.split()[0] for line in lines) == sorted(runner.EXPERIMENTS)
    for line in lines:
        name, *rest = line.split()
        assert name not in rest, line                                  # the name once, not name and kind


def test_list_of_a_directory_has_a_header_and_each_config_once(tmp_path, capsys):
    (tmp_path / "mine.toml").write_text('kind = "bubble_sweep"\ndescription = "my sweep"\n')
    assert cli.main(["list", str(tmp_path)]) == 0
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.split() == ["config", "kind", "description"]
    assert [line.split() for line in lines] == [[str(tmp_path / "mine.toml"), "bubble_sweep", "my", "sweep"]]


# ---- progress text is literal -----------------------------------------------------------------
def test_progress_descriptions_render_literally():
    """rich would read ':B:' of 'F:B:W' as an emoji code and '[x]' as markup."""
    stream = io.StringIO()
    with progress.bars(enabled=True, stream=stream):
        for _ in progress.track(range(2), "schedule search: F:B:W x comm [x]"):
            pass
        with progress.counter("a:B:b [bold]") as advance:
            advance()
    out = stream.getvalue()
    assert "schedule search: F:B:W x comm [x]" in out and "a:B:b [bold]" in out, out
    assert "\N{NEGATIVE SQUARED LATIN CAPITAL LETTER B}" not in out


# ---- the bubble sweep's headline counts every row ------------------------------------------
def _sweep(schedules, multipliers):
    c = parse(bubble_sweep.Config, {"kind": "bubble_sweep", "sweep": {
        "schedules": schedules, "num_stages": [4], "microbatch_multipliers": multipliers}})
    return c, [bubble_sweep.sweep_row(c, point) for point in bubble_sweep.grid(c)]


def test_bubble_sweep_headline_counts_the_rows_not_run_and_says_why():
    c, rows = _sweep(["1f1b", "dualpipe"], [1, 2])       # dualpipe at m = P = 4 cannot run (m >= 2P)
    assert [r.schedule for r in rows if r.note] == ["dualpipe"]
    s = bubble_sweep.summarize(rows, c)
    head = s["headline"]
    assert "4 rows, 3 simulated" in head, head
    assert "1 not run (dualpipe x1, e.g. P=4, m=4: dualpipe needs num_microbatches >= 2 * num_ranks" in head, head
    assert (s["rows"], s["simulated"], s["skipped"]) == (4, 3, 1)
    assert s["not_run"] == [{"schedule": "dualpipe", "P": 4, "microbatches": 4,
                             "reason": "dualpipe needs num_microbatches >= 2 * num_ranks = 8, got 4"}]
    c, rows = _sweep(["1f1b"], [1, 2])
    assert "2 rows, 2 simulated" in bubble_sweep.summarize(rows, c)["headline"]
    assert "every row run" in bubble_sweep.summarize(rows, c)["headline"]


# ---- where executed ranks run ------------------------------------------------------------------
def test_executed_placement_says_when_ranks_share_cores():
    run = executed_bubbles.Run(schedules=["1f1b"], ranks=4, microbatches=8)
    shared = executed_bubbles.placement(run, cores=2)
    assert "4 ranks on 2 cores, shared" in shared and "of its own" not in shared.split(":")[0], shared
    assert "a core of its own" in executed_bubbles.placement(run, cores=4)
    threads = executed_bubbles.Run(schedules=["1f1b"], ranks=4, microbatches=8, cluster=False)
    assert "thread" in executed_bubbles.placement(threads, cores=2)
    assert executed_bubbles.host_cores() >= 1


def test_quickstart_executed_section_runs_ranks_beyond_the_devices_and_says_how(tmp_path, monkeypatch):
    """The section runs a process per rank (executed_bubbles' default): it needs no jax device
    per rank, so more ranks than devices run (sharing the cores), never a skip naming devices."""
    import jax

    c = runner.load_config("quickstart", ["executed.ranks=16", "executed.microbatches=16",
                                          'executed.schedules=["1f1b"]'])
    assert c.executed.ranks > jax.device_count()
    ran = []

    def fake_run(sub_cfg, out_dir):
        ran.append(sub_cfg)
        return results.Result("t", "h", objects={"row_objects": []})

    monkeypatch.setattr(executed_bubbles, "run", fake_run)
    monkeypatch.setattr(executed_bubbles, "report_table", lambda rows: "TABLE\n")
    monkeypatch.setattr(executed_bubbles, "host_cores", lambda: 2)
    section = quickstart.executed_pipeline_section(c, str(tmp_path))
    assert [(s.run.ranks, s.run.cluster) for s in ran] == [(16, True)]
    assert "skipped" not in section.markdown and "devices" not in section.markdown
    assert "16 ranks on 2 cores, shared" in section.markdown
