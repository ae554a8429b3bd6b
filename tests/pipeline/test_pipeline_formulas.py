"""Closed forms vs the simulator: exact where formula_conditions says so."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp
from pdjax.schedules.comparison import compare_one
from pdjax.schedules.formulas import bubble_ratio_1f1b, dualpipe_bubble, dualpipe_makespan, min_microbatches_1f1b

costs = st.floats(0.1, 3.0, allow_nan=False, allow_infinity=False)


def test_brief_1f1b_ratios():
    """Published 1F1B figures: P = 16, m in 16..256 -> 48.4 %, 31.9 %, 19.0 %, 10.5 %, 5.5 %."""
    p = 16
    expected = {16: 48.4, 32: 31.9, 64: 19.0, 128: 10.5, 256: 5.5}
    for m, pct in expected.items():
        assert round(100 * bubble_ratio_1f1b(p, m), 1) == pct
    assert min_microbatches_1f1b(p, 0.10) == 136
    for p in (2, 4, 8, 32):
        m = min_microbatches_1f1b(p, 0.10)
        assert bubble_ratio_1f1b(p, m) < 0.10 <= bubble_ratio_1f1b(p, m - 1)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 10), k=st.integers(1, 4), f=costs, i=costs, w=costs)
def test_zb1p_formula_where_it_applies(p, k, f, i, w):
    m = k * p
    t = pp.simulate(pp.build("zb1p", p, m), F=f, B=i + w, W=w)
    applies, why = pp.formula_conditions("zb1p", F=f, B=i + w, W=w)
    formula = pp.bubble_formula("zb1p", p, F=f, B=i + w, W=w)
    if applies:
        assert t.bubble.max() == pytest.approx(formula)
    else:
        assert "W <= min(F, I)" in why


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(1, 3), f=costs, w=costs, extra=st.floats(0.0, 2.0))
def test_readme_dualpipe_formula_when_f_equals_i(n, k, f, w, extra):
    """F = I >= W and FB >= max(F, B): middle ranks' bubble is (P/2-1)(FB+B-3W)."""
    assume(w <= f)
    b = f + w
    fb = max(f, b) + extra
    p = 2 * n
    for name, ranks, c in (("dualpipe", p, 2 * p * k), ("dualpipev", n, 2 * n * k)):
        t = pp.simulate(pp.build(name, ranks, c), F=f, B=b, W=w, FB=fb)
        mid = ranks // 2 - 1 if name == "dualpipe" else ranks - 1
        assert pp.formula_conditions(name, F=f, B=b, W=w, FB=fb)[0]
        assert t.bubble[mid] == pytest.approx(pp.bubble_formula(name, p, F=f, B=b, W=w, FB=fb))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(1, 3), extra_mb=st.integers(0, 3), f=costs, i=costs, w=costs,
       over=st.floats(0.0, 3.0))
def test_general_dualpipe_expression(n, k, extra_mb, f, i, w, over):
    """The general makespan/bubble expression found with the simulator, any F, I, W."""
    b = i + w
    fb = max(f, b) + over
    for name, ranks, c in (("dualpipe", 2 * n, 2 * (2 * n * k + extra_mb)), ("dualpipev", n, 2 * n * k + extra_mb)):
        t = pp.simulate(pp.build(name, ranks, c), F=f, B=b, W=w, FB=fb)
        assert t.makespan == pytest.approx(dualpipe_makespan(name, ranks, c, F=f, B=b, W=w, FB=fb))
        np.testing.assert_allclose(t.bubble, dualpipe_bubble(name, ranks, c, F=f, B=b, W=w, FB=fb),
                                   atol=1e-9 * t.makespan)


def test_formula_not_applicable_is_said_and_differs():
    p, f, i, w, fb = 8, 1.0, 2.0, 0.5, 3.0
    applies, why = pp.formula_conditions("dualpipe", F=f, B=i + w, W=w, FB=fb)
    assert not applies and "F = I >= W" in why
    t = pp.simulate(pp.build("dualpipe", p, 4 * p), F=f, B=i + w, W=w, FB=fb)
    assert t.bubble[p // 2 - 1] != pytest.approx(pp.bubble_formula("dualpipe", p, F=f, B=i + w, W=w, FB=fb))
    assert not pp.formula_conditions("1f1b", comm=0.1)[0]
    assert not pp.formula_conditions("1f1b", F=[1.0, 2.0])[0]


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_memory_table_one_stage_schedules(name, p):
    s = pp.build(name, p, 4 * p)
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0)
    table = pp.memory_table(name, p)
    assert max(t.peak_activations) == table["activations"]
    if name == "1f1b":  # rank r holds P - r
        assert t.peak_activations.tolist() == list(range(p, 0, -1))
    else:  # ZB-H1: a W holds its micro-batch's activations, so every rank holds P
        assert t.peak_activations.tolist() == [p] * p
    assert set(s.param_copies()) == {table["params"]}
    assert s.num_ranks == table["devices"]


def test_report_rows():
    rows = pp.compare(["1f1b", "zb1p", "dualpipe", "dualpipev"], [4, 8], lambda p: [p, 4 * p],
                      F=1.0, B=2.0, W=1.0, FB=2.5)
    assert len(rows) == 16
    skipped = [r for r in rows if r.note]
    assert {(r.schedule, r.microbatches == r.P) for r in skipped} == {("dualpipe", True)}
    for r in rows:
        if not r.note:
            assert r.formula_applies and r.sim_bubble == pytest.approx(r.formula_bubble)
            assert r.peak_activations == r.table_activations  # W-aware count = README column
    text = pp.format_report(rows)
    assert "not applicable" in text and "exact" in text
    row = compare_one("dualpipe", 8, 32, F=1.0, B=3.0, W=1.0, FB=3.5)
    assert not row.formula_applies and row.general_bubble == pytest.approx(row.sim_bubble)
    assert "n/a" in pp.format_report([row])


def test_bad_formula_inputs():
    with pytest.raises(ValueError, match="unknown schedule name"):
        pp.bubble_formula("nope", 4)
    with pytest.raises(ValueError, match="num_stages"):
        pp.bubble_formula("1f1b", 0)
    with pytest.raises(ValueError, match="even"):
        pp.bubble_formula("dualpipe", 5)
