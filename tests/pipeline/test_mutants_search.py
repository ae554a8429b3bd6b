"""The schedule search's edges that its main tests left unpinned (found by mutation testing,
docs/mutation.md): the gap for sub-unit costs, a full per-stage memory model, the greedy
policies it tries and the names of what it builds, the MILP's answer when nothing beats the
greedy incumbent, and its report when the time limit left it no time."""

import pytest

from pdjax.schedules.greedy import Policy
from pdjax.schedules.search import search

SMALL = dict(F=0.01, B=0.02, W=0.01, comm=0.005, families=["zb"], time_limit_s=20)


@pytest.fixture(scope="module")
def tight():
    """3 ranks, 6 micro-batches, 10 ms ops, a budget of 2 micro-batches' activations."""
    return search(3, 6, memory_budget=2.0, **SMALL)


def test_the_gap_is_measured_for_a_lower_bound_below_one(tight):
    assert 0 < tight.lower_bound < 1
    assert tight.makespan > tight.lower_bound
    assert tight.gap == pytest.approx(tight.makespan / tight.lower_bound - 1.0) and tight.gap > 0


def test_nothing_beats_the_greedy_incumbent_so_it_is_reported_optimal(tight):
    """With the budget binding the MILP finds no schedule better than the best fitting greedy
    one of its layout: that incumbent is optimal, and the report says so with it as both the
    objective and the bound."""
    best_greedy = min(c.makespan for c in tight.candidates
                      if c.label.startswith("greedy") and c.peak_memory <= 2.0 + 1e-9)
    assert tight.milp["status"] == "optimal (greedy)"
    assert tight.milp["objective"] == tight.milp["dual_bound"] == pytest.approx(best_greedy)


def test_the_greedy_pool_tries_every_documented_policy_and_names_its_schedules(tight):
    """Every greedy policy (F-first or not, W lag none / 0 / 1, deep; no F&B pairs for ZB)
    is tried, and each schedule it builds is named after the family searched."""
    tried = {c.label.split(" cap ")[0] for c in tight.candidates if c.label.startswith("greedy")}
    want = {f"greedy {Policy(ff, lag, True, False).label()}" for ff in (False, True) for lag in (None, 0, 1)}
    assert tried == want
    assert {c.schedule.name for c in tight.candidates if c.label.startswith("greedy")} == {"search-zb"}


def test_a_full_memory_model_is_accepted_and_the_defaults_are_its_values():
    """memory with all three keys (F, I, I_free) is accepted; giving the defaults (1, 0, 0)
    finds what giving none does."""
    plain = search(2, 4, **SMALL)
    full = search(2, 4, memory={"F": 1.0, "I": 0.0, "I_free": 0.0}, **SMALL)
    assert (full.makespan, full.label, full.lower_bound) == (plain.makespan, plain.label, plain.lower_bound)
    with pytest.raises(ValueError, match="memory"):
        search(2, 4, memory={"F": 1.0, "X": 0.0}, **SMALL)


def test_a_search_out_of_time_reports_the_milp_skipped_with_every_key():
    r = search(4, 16, time_limit_s=1e-6, families=["zb"])
    assert r.milp == {"status": "skipped (time limit)", "objective": None, "dual_bound": None}
    assert r.complete is False
