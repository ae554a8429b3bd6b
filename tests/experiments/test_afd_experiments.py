"""The AFD measurement and the afd_ratio experiment: the stage times leave out the wait behind
the other mesh's programs, the issue-order and overlap models give the step they describe
on hand-computed stages, the simulated sweep's speedup is its throughput ratio, and a small
``pdjax run`` of afd_ratio writes finite measured rows, tables, a plot and a report (no
timing thresholds: the numbers are the machine's)."""

import dataclasses
import json
import math
import os

import pytest

import pdjax
from pdjax.experiments import afd_measure, afd_ratio, runner
from pdjax.sim.afd_step import afd_layer_cycle


def _span(stream, layer, mb, issued, ready, step=0):
    return {"stream": stream, "name": f"step {step} layer {layer} mb {mb}", "issued": issued, "ready": ready,
            "chain": (step, mb)}


def test_ffn_time_leaves_out_the_wait_behind_the_attention_programs():
    # XLA:CPU: F0 (its input landed at 1.5) could only start when A1 finished at 2
    spans = [_span("attention", 1, 0, 0.0, 1.0), _span("a2f", 1, 0, 0.0, 1.5),
             _span("attention", 1, 1, 0.0, 2.0), _span("ffn", 1, 0, 0.1, 3.0)]
    st = afd_measure.stage_medians(spans)
    assert st["ffn"] == {1: 1.0} and st["attention"] == {1: 1.0} and st["a2f"] == {1: 0.5}
    assert afd_measure.stage_medians(spans, skip_steps=1) == {}
    later = [_span("attention", 1, 0, 5.0, 6.0, step=1), _span("ffn", 1, 0, 5.4, 7.0, step=1)]
    assert afd_measure.issue_window_s(spans + later) == pytest.approx(0.25)        # median of 0.1 and 0.4
    assert afd_measure.issue_window_s(spans + later, skip_steps=1) == pytest.approx(0.4)


STAGES = {"attention": {1: 1.0, 2: 1.0, "head": 0.25}, "ffn": {1: 1.0, 2: 1.0},
          "a2f": {1: 0.5, 2: 0.5}, "f2a": {1: 0.5, 2: 0.5}}


def test_issue_order_model_by_hand():
    # one layer, m = 2: A0 0-1, A1 1-2, F0 2-3 (input at 1.5), F1 3-4 (at 2.5); back at 3.5, 4.5
    one = {st: {k: v for k, v in by.items() if k != 2} for st, by in STAGES.items()}
    assert afd_measure.issue_order_step(one, 2) == pytest.approx(4.5 + 0.25)
    # m = 1 serialises everything: per layer A + A2F + F + F2A
    assert afd_measure.issue_order_step(STAGES, 1) == pytest.approx(2 * 3.0 + 0.25)
    free = {**STAGES, "a2f": {1: 0, 2: 0}, "f2a": {1: 0, 2: 0}}          # no exchange: m (T_a + T_f) a layer
    assert afd_measure.issue_order_step(free, 3) == pytest.approx(2 * 3 * 2.0 + 3 * 0.25)


def test_overlap_model_is_the_simulators_cycle_on_the_measured_stages():
    stages = {**STAGES, "ffn": {1: 2.0, 2: 2.0}, "f2a": {1: 1.5, 2: 1.5}}      # T_c = (0.5 + 1.5) / 2 = 1
    for m in (1, 2, 3):
        p = afd_measure.predict_from_stages(stages, m, slots=12 * m, num_attention=4, num_ffn=4, row_bytes=128.0)
        assert p["step_overlap_ms"] == pytest.approx(1e3 * (2 * afd_layer_cycle(1.0, 2.0, 1.0, m) + m * 0.25))
        assert p["t_comm_ms"] == pytest.approx(1e3) and p["pingpong_min_m"] == pytest.approx(3.0)
        assert p["pingpong_hides"] == (m >= 3) and p["dbo_hides_ffn"] is False


def test_issue_order_copies_of_one_direction_run_one_at_a_time():
    # one layer, m = 2, A2F 2 > attention 1: A0 0-1, A1 1-2; A2F 1-3 then 3-5 (one link);
    # F0 3-4, F1 5-6; F2A 4-4.5, 6-6.5
    one = {"attention": {1: 1.0}, "a2f": {1: 2.0}, "ffn": {1: 1.0}, "f2a": {1: 0.5}}
    assert afd_measure.issue_order_step(one, 2) == pytest.approx(6.5)


def test_dbo_condition_takes_the_exchanges_round_trip():
    # T_a = 2, T_f = 1, A2F = F2A = 0.75: the round trip 1 + 1.5 > 2 does not fit under the
    # other micro-batch's attention (the scheduled m = 2 cycle is 4.5 > 2 T_a)
    stages = {"attention": {1: 2.0}, "a2f": {1: 0.75}, "ffn": {1: 1.0}, "f2a": {1: 0.75}}
    p = afd_measure.predict_from_stages(stages, 2)
    assert p["dbo_hides_ffn"] is False and p["exchange_hidden"] is False
    assert p["step_overlap_ms"] == pytest.approx(1e3 * 4.5)


def test_simulated_speedup_is_the_throughput_ratio_per_accelerator():
    hw, sweep = afd_ratio.Hardware(), afd_ratio.Sweep()
    rows, notes = afd_ratio.sim_rows(pdjax.configs.deepseek_v3(), hw, sweep)
    assert not notes and len(rows) == len(sweep.attention) * len(sweep.contexts)
    for r in rows:
        assert r["speedup"] == pytest.approx(r["tok_s_per_gpu_afd"] / r["tok_s_per_gpu_base"])
        assert r["attention_share"] == r["M"] / (r["M"] + r["N"])
    bf16 = dataclasses.replace(hw, dtype="bf16")                   # 1.3 TB of experts on 8 x 80 GB
    rows, notes = afd_ratio.sim_rows(pdjax.configs.deepseek_v3(), bf16, dataclasses.replace(sweep, ffn=8))
    assert rows == [] and "do not fit" in notes[0]


@pytest.mark.parametrize("override, message", [
    ('hardware.attention="h30"', "hardware.attention: unknown hardware"),
    ("measured.new_tokens=20", r"measured.new_tokens: out of range, got 20 \(at least measured.slots \+ 3\)"),
    ("measured.microbatches=[5]", "measured.microbatches: out of range"),
    ('measured.preset="huge"', "measured.preset: must be one of"),
])
def test_bad_afd_ratio_configs_fail_before_anything_runs(override, message):
    with pytest.raises(ValueError, match=message):
        runner.load_config("afd_ratio", [override])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("afd")
    sets = ["measured.microbatches=[2]", "measured.slots=8", "measured.new_tokens=11",
            "sweep.attention=[16, 64]", "sweep.contexts=[16384]"]
    return runner.run("afd_ratio", runs_dir=str(tmp), overrides=sets)


def test_afd_ratio_measures_finite_stages_and_writes_its_report(run):
    out_dir, result = run
    (row,) = result.wall_clock["measured"]
    assert (row["M"], row["N"], row["m"], row["slots"]) == (4, 4, 2, 8) and row["steps"] >= 10
    for key in ("t_attn_ms", "t_ffn_ms", "t_a2f_ms", "t_f2a_ms", "t_head_ms", "host_issue_ms", "step_measured_ms",
                "step_traced_ms",
                "step_issue_order_ms", "step_overlap_ms", "speedup_measured", "speedup_predicted"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert math.isfinite(row["err_issue_order_pct"]) and isinstance(row["dbo_hides_ffn"], bool)
    assert [r["label"] for r in result.metrics["rows"]] == ["16A16F", "64A16F"]
    saved = json.load(open(os.path.join(out_dir, "metrics.json")))
    assert saved["tables"]["afd_measured"]["wall_clock"] and not saved["tables"]["afd_ratio"]["wall_clock"]
    names = set(os.listdir(out_dir))
    assert {"afd_ratio.png", "afd_ratio.svg", "afd_ratio.csv", "afd_measured.csv", "report.md"} <= names
    assert "issue-order model" in open(os.path.join(out_dir, "report.md")).read()
