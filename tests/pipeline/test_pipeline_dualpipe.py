"""DualPipe / DualPipeV op order against independent derivations."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp
from pdjax.schedules.ops import FB, Op, parse_op
from pipeline_reference import reference_dualpipe, reference_dualpipev

DATA = Path(__file__).parent / "data"


def _strings(schedule):
    return [[str(op) for op in ops] for ops in schedule.ops]


def test_dualpipev_matches_torch_artifact():
    text = (DATA / "torch_dualpipev_4rank_10mb.csv").read_text()
    rows = [r for r in text.splitlines() if r.strip()]
    num_ranks = len(rows)
    num_mb = 1 + max(op.microbatch for r in rows for c in r.split(",") for op in parse_op(c).parts)
    s = pp.build("dualpipev", num_ranks=num_ranks, num_microbatches=num_mb)
    assert s.to_csv() == text
    imported = pp.Schedule.from_csv(text)
    assert imported.ops == s.ops
    assert imported.layout.stage_rank == s.layout.stage_rank


@pytest.mark.parametrize("num_ranks,num_mb", [(2, 4), (2, 6), (4, 8), (4, 10), (4, 20), (6, 12), (8, 16), (8, 20),
                                              (8, 22), (10, 40), (16, 32)])
def test_dualpipe_matches_reference_emulation(num_ranks, num_mb):
    assert _strings(pp.build("dualpipe", num_ranks, num_mb)) == reference_dualpipe(num_ranks, num_mb)


@pytest.mark.parametrize("num_ranks,num_mb", [(1, 2), (1, 5), (2, 4), (3, 7), (4, 8), (4, 10), (5, 13), (8, 16)])
def test_dualpipev_matches_reference_emulation(num_ranks, num_mb):
    assert _strings(pp.build("dualpipev", num_ranks, num_mb)) == reference_dualpipev(num_ranks, num_mb)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), extra=st.integers(0, 12))
def test_dualpipev_is_first_half_of_dualpipe(n, extra):
    """DualPipeV(N, C) == first N ranks of DualPipe(2N, 2C), stages relabelled."""
    c = 2 * n + extra
    v = pp.build("dualpipev", n, c)
    d = pp.build("dualpipe", 2 * n, 2 * c)
    relabel = {s: s for s in range(n)}  # direction-0 stages keep their ids
    relabel.update({4 * n - 1 - r: 2 * n - 1 - r for r in range(n)})  # direction-1 stage on rank r

    def mb(stage, m):
        return m - c if stage >= 2 * n else m

    def conv(op):
        if op.kind == "F&B":
            return FB(conv(op.forward), conv(op.backward))
        return Op(op.kind, relabel[op.stage], mb(op.stage, op.microbatch))

    assert [tuple(conv(op) for op in ops) for ops in d.ops[:n]] == list(v.ops)


@settings(max_examples=30, deadline=None)
@given(n_half=st.integers(1, 8), extra=st.integers(0, 10))
def test_dualpipe_structure(n_half, extra):
    """Overlapped pairs, the non-overlapped pair and memory follow the README."""
    num_ranks = 2 * n_half
    c = 2 * num_ranks + 2 * extra
    s = pp.build("dualpipe", num_ranks, c).validate()
    half = c // 2
    for r, ops in enumerate(s.ops):
        h = min(r, num_ranks - 1 - r)
        middle = h == n_half - 1
        pairs = sum(op.kind == "F&B" for op in ops)
        assert pairs == 2 * (half - 2 * n_half + h + 1) + (n_half - h - 1) - (1 if middle else 0)
        # every stage on this rank: one F and one backward per micro-batch of its direction
        for stage in s.layout.stages_on_rank(r):
            kinds = [p.kind for op in ops for p in op.parts if p.stage == stage]
            assert kinds.count("F") == half
            assert kinds.count("B") + kinds.count("I") == half
            assert kinds.count("W") == kinds.count("I")
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5)
    table = pp.memory_table("dualpipe", num_ranks)
    assert t.peak_activations.tolist() == [table["activations"]] * num_ranks  # P+1 on every rank
    assert set(s.param_copies()) == {table["params"]}
    assert s.num_ranks == table["devices"]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 8), extra=st.integers(0, 10))
def test_dualpipev_memory_matches_table(n, extra):
    s = pp.build("dualpipev", n, 2 * n + extra)
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0, FB=2.5)
    table = pp.memory_table("dualpipev", s.num_stages)
    assert t.peak_activations.tolist() == [table["activations"]] * n  # P+1 = 2N+1 on every rank
    assert set(s.param_copies()) == {table["params"]}
    assert s.num_ranks == table["devices"]


def test_weight_queue_pops_oldest_across_phases():
    """On a rank where step 6 queues weight-grads of both phases, W follows queue order."""
    s = pp.build("dualpipev", 4, 10)
    ops = s.ops[1]
    queued = [op for op in ops if op.kind == "I"]
    weights = [op for op in ops if op.kind == "W"]
    assert [(w.stage, w.microbatch) for w in weights] == [(i.stage, i.microbatch) for i in queued]
    assert len({w.stage for w in weights}) == 2


@pytest.mark.parametrize("name,ranks,mb,rule", [
    ("dualpipe", 3, 12, "even num_ranks"),
    ("dualpipe", 4, 9, "even num_microbatches"),
    ("dualpipe", 4, 6, ">= 2 * num_ranks"),
    ("dualpipev", 4, 7, ">= 2 * num_ranks"),
    ("dualpipe", 0, 8, "num_ranks"),
    ("dualpipev", 2, -1, "num_microbatches"),
])
def test_dualpipe_rules(name, ranks, mb, rule):
    with pytest.raises(ValueError, match=rule.replace("*", r"\*")):
        pp.build(name, ranks, mb)
