"""The schedule_search experiment on a shrunken config (P = 3, m = 6, one ratio, two
latencies, no execution): tables and metrics against search() and the candidates."""

import csv
import math

import pytest

import pdjax.pipeline as pp
from pdjax.experiments import runner

CFG = '''kind = "schedule_search"
name = "ss"
[search]
num_ranks = 3
num_microbatches = 6
families = ["zb", "v"]
budgets_x_1f1b = [0.5, 1.0]
time_limit_s = 60.0
[costs]
ratios = [[1.0, 2.0, 1.0]]
comms = [0.0, 0.1]
[execute]
enabled = false
'''


def test_schedule_search_experiment(tmp_path):
    path = tmp_path / "ss.toml"
    path.write_text(CFG)
    run_dir, result = runner.run(str(path), runs_dir=str(tmp_path / "runs"))
    gaps = list(csv.DictReader(open(f"{run_dir}/gaps.csv")))
    cands = list(csv.DictReader(open(f"{run_dir}/candidates.csv")))
    assert (tmp_path / "runs").exists() and "frontier" in result.figures
    assert [(g["comm"], g["budget_x_1f1b"]) for g in gaps] == [("0.0", "0.5"), ("0.0", "1.0"), ("0.1", "0.5"), ("0.1", "1.0")]
    for comm in (0.0, 0.1):
        ref = pp.search(3, 6, F=1.0, B=2.0, W=1.0, comm=comm, families=("zb", "v"), milp_max_ops=0)
        setting = result.metrics["settings"][f"F:B:W=1:2:1 comm={comm:g}"]
        assert setting["complete"] and setting["lower_bound"] == pytest.approx(ref.lower_bound)
        assert [tuple(p) for p in setting["frontier"]] == [tuple(p) for p in ref.frontier]
        mine = [c for c in cands if float(c["comm"]) == comm]
        assert {c["label"] for c in mine if c["kind"] == "hand-written"} >= {"1f1b", "zb1p", "zbv", "v-half"}
        for g in (g for g in gaps if float(g["comm"]) == comm):
            budget = float(g["budget_x_1f1b"]) * 3
            best = min(float(c["makespan"]) for c in mine if float(c["peak_memory"]) <= budget + 1e-9)
            assert float(g["makespan"]) == pytest.approx(best)
            assert float(g["gap"]) == pytest.approx(best / ref.lower_bound - 1) and float(g["gap"]) >= -1e-9
            fits = [(c.makespan, c.peak_memory) for c in ref.candidates if c.peak_memory <= budget + 1e-9]
            assert best == pytest.approx(min(fits)[0])
    assert not math.isnan(float(gaps[0]["gap"]))


@pytest.mark.parametrize("override,match", [
    ("costs.ratios=[[1.0, 2.0]]", "costs.ratios\\[0\\]"),
    ("costs.ratios=[[1.0, 1.0, 2.0]]", "must not exceed B"),
    ("search.families=[\"zz\"]", "search.families"),
])
def test_schedule_search_bad_config(tmp_path, override, match):
    path = tmp_path / "ss.toml"
    path.write_text(CFG)
    with pytest.raises(ValueError, match=match):
        runner.load_config(str(path), overrides=[override])
