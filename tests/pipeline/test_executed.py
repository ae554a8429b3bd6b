"""Executed schedules against their simulation (pdjax.pipeline.measurement) and the
executed_bubbles experiment, on the session's tiny executor case (2 ranks x 4 micro-batches)."""

import json
import math
import os
from pathlib import Path

import pytest

from pdjax.experiments import runner
from pdjax.experiments.executed_bubbles import report_table
from pdjax.pipeline.measurement import COLUMNS, measure_executor, text_table


def _check_row(row):
    assert row.measured_peak_bytes == row.simulated_peak_bytes
    assert len(row.measured_peak_bytes) == row.ranks and min(row.measured_peak_bytes) > 0
    assert row.measured_makespan_ms > 0 and row.simulated_makespan_ms > 0
    assert row.makespan_error == pytest.approx(row.simulated_makespan_ms / row.measured_makespan_ms - 1)
    assert 0 <= row.measured_bubble_ratio < 1 and 0 <= row.simulated_bubble_ratio < 1
    assert math.isnan(row.formula_bubble_ratio) or 0 <= row.formula_bubble_ratio < 1
    assert row.formula_note and row.dispatch_ms > 0


def test_measured_row(executor, exec_params, exec_tokens):
    row = measure_executor(executor("zb1p"), exec_params, exec_tokens, repeats=3, op_repeats=1)
    _check_row(row)
    s = executor("zb1p").schedule
    assert (row.schedule, row.P, row.ranks, row.microbatches) == ("zb1p", s.num_ranks, s.num_ranks, s.num_microbatches)
    # the reported timeline is the median of the measured steps
    assert row.measured.makespan == row.measured_makespan_ms == sorted(row.step_makespans_ms)[1]
    assert list(row.simulated.peak_memory) == list(row.simulated_peak_bytes)
    assert set(COLUMNS) <= set(row.as_dict()) and json.dumps(row.as_dict())
    assert "zb1p" in report_table([row]) and "zb1p" in text_table([row])
    # the tables show the spread over the measured steps, not one number
    lo, mid, hi = sorted(row.step_makespans_ms)
    spread = f"{mid:.1f} [{lo:.1f}-{hi:.1f}]"
    assert spread in report_table([row]) and spread in text_table([row]), text_table([row])


def test_experiment_writes_table_and_plots(tmp_path, exec_cfg, exec_tokens, executor):
    # the session executor's model, batch and schedule size, so compiled programs are shared
    s = executor("1f1b").schedule
    (B, T), m = exec_tokens.shape, s.num_microbatches
    cfg = tmp_path / "e.toml"
    cfg.write_text('kind = "executed_bubbles"\n'
                   f'[run]\nschedules = ["1f1b"]\nranks = {s.num_ranks}\nmicrobatches = {m}\n'
                   'repeats = 1\nop_repeats = 1\ncluster = false\n'
                   f'[model]\nlayers = {exec_cfg.num_hidden_layers}\ndense_layers = {exec_cfg.first_k_dense_replace}\n'
                   f'[batch]\nrows = {B // m}\nseq_len = {T}\n')
    out_dir, summary = runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
    for f in ("1f1b.png", "executed_bubbles.csv", "executed_bubbles.json", "report.md"):
        assert os.path.getsize(os.path.join(out_dir, f)) > 0, f
    assert "(1f1b.png)" in Path(out_dir, "report.md").read_text()
    _check_row(summary["row_objects"][0])
    saved = json.loads(Path(out_dir, "executed_bubbles.json").read_text())["rows"][0]
    assert saved["measured_peak_bytes"] == saved["simulated_peak_bytes"]


@pytest.mark.parametrize("text, name", [
    ("[run]\nsceal = 2", "sceal"),
    ("[batch]\nrows = 2\nseqlen = 8", "seqlen"),
    ("[modle]\nlayers = 2", "modle"),
    ("[run]\nschedules = [\"1f2b\"]", "1f2b"),
    ("[run]\nscale = 0", "scale"),
])
def test_bad_experiment_config_is_named(tmp_path, text, name):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('kind = "executed_bubbles"\n' + text + "\n")
    with pytest.raises(ValueError, match=name):
        runner.run(str(cfg), runs_dir=str(tmp_path / "runs"))
