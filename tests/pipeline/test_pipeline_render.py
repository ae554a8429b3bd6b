"""Plots, text rendering, Chrome trace, notebook display, and the bubble sweep."""

import json
import tomllib
from pathlib import Path

import pytest

import pdjax.schedules as pp
from pdjax.experiments import bubble_sweep
from pdjax.experiments.schema import parse

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timeline():
    return pp.simulate(pp.build("dualpipe", 4, 8), F=1.0, B=2.0, W=1.0, FB=2.5)


def test_plot_png_and_svg(tmp_path, timeline):
    png, svg = tmp_path / "g.png", tmp_path / "g.svg"
    pp.plot(timeline, png)
    pp.plot(pp.build("zb1p", 3, 6), svg, F=1.0, B=2.0, W=1.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:400]
    with pytest.raises(ValueError, match="must end in"):
        pp.plot(timeline, tmp_path / "g.txt")


def test_text_rendering(timeline):
    text = timeline.to_text(width=60)
    lines = text.splitlines()
    assert len(lines) == 1 + timeline.schedule.num_ranks
    assert all(len(line.split("|")[1]) == 60 for line in lines[1:])
    grid = timeline.schedule.to_text()
    assert len(grid.splitlines()) == 1 + max(len(o) for o in timeline.schedule.ops)


def test_chrome_trace(tmp_path, timeline):
    path = tmp_path / "t.json"
    trace = timeline.to_chrome_trace(path, time_scale_us=1.0)
    loaded = json.loads(path.read_text())
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == timeline.schedule.num_ops
    last = max(e["ts"] + e["dur"] for e in spans)
    assert last == pytest.approx(timeline.makespan)
    assert trace == loaded


def test_notebook_display(timeline):
    assert timeline._repr_png_()[:4] == b"\x89PNG"
    assert "makespan" in timeline._repr_html_()
    s = timeline.schedule
    assert s._repr_png_()[:4] == b"\x89PNG"
    assert "rank 0" in s._repr_html_()


def _sweep_config(tables: dict):
    return parse(bubble_sweep.Config, {"kind": "bubble_sweep", **tables})


def test_bubble_sweep_config_runs():
    cfg = tomllib.loads((ROOT / "pdjax" / "experiments" / "configs" / "bubble_sweep.toml").read_text())
    assert cfg["sweep"]["num_stages"] == [4, 8, 16, 32]
    c = _sweep_config({"sweep": dict(cfg["sweep"], num_stages=[4, 8], microbatch_multipliers=[1, 2]),
                       "costs": cfg["costs"]})
    rows = [bubble_sweep.sweep_row(c, point) for point in bubble_sweep.grid(c)]
    out = bubble_sweep.summarize(rows, c)
    n_sched = len(cfg["sweep"]["schedules"])
    assert len(rows) == out["rows"] == n_sched * 2 * 2
    assert out["formula_mismatches"] == 0 and out["max_abs_error_where_applies"] == 0.0
    assert bubble_sweep.figure(rows, c)._repr_png_()[:4] == b"\x89PNG"
    assert "bubble ratio at P=" in out["headline"]


@pytest.mark.parametrize("bad,pattern", [
    ({"sweep": {"schedules": ["nope"]}}, r"sweep\.schedules.*must be one of"),
    ({"sweep": {"num_stages": [0]}}, r"sweep\.num_stages: must be >= 1, got 0"),
    ({"costs": {"F": -1}}, "costs.F"),
    ({"costs": {"X": 1}}, r"costs\.X: unknown key"),
    ({"sweep": {"bogus": 1}}, r"sweep\.bogus: unknown key"),
])
def test_bubble_sweep_bad_config(bad, pattern):
    with pytest.raises(ValueError, match=pattern):
        _sweep_config(bad)


def test_plot_draws_on_the_axes_it_is_given():
    from matplotlib.figure import Figure

    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    assert pp.plot(pp.build("1f1b", 2, 4), ax=ax2) is fig
    assert len(ax2.patches) + len(ax2.collections) > 0 and not ax1.collections
