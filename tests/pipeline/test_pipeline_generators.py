"""Every generator, property-tested over ranks 2..16 and micro-batches 1..64."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp

NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev"]


def _valid(name, p, m, v=2):
    if name == "dualpipe":
        return p % 2 == 0 and m % 2 == 0 and m >= 2 * p
    if name == "dualpipev":
        return m >= 2 * p
    if name == "interleaved-1f1b":
        return v == 1 or m % p == 0
    return True


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), p=st.integers(2, 16), m=st.integers(1, 64), v=st.integers(1, 3))
def test_generators_valid_or_named_rule(name, p, m, v):
    opts = {"num_stages_per_rank": v} if name == "interleaved-1f1b" else {}
    if not _valid(name, p, m, v):
        with pytest.raises(ValueError, match="needs"):
            pp.build(name, p, m, **opts)
        return
    s = pp.build(name, p, m, **opts)
    s.validate()
    assert s.num_ranks == p
    assert s.num_microbatches == m
    # independent count check: per stage, one F and one backward per micro-batch of its pipeline
    for pipe in s.layout.pipelines:
        for stage in pipe.stages:
            r = s.layout.stage_rank[stage]
            parts = [q for op in s.ops[r] for q in op.parts if q.stage == stage]
            fwd = sorted(q.microbatch for q in parts if q.kind == "F")
            bwd = sorted(q.microbatch for q in parts if q.kind in "BI")
            assert fwd == list(pipe.microbatches) == bwd


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 16), m=st.integers(1, 64))
def test_1f1b_warmup_and_memory(p, m):
    s = pp.build("1f1b", p, m)
    t = pp.simulate(s, F=1.0, B=2.0, W=0.0)
    for r, ops in enumerate(s.ops):
        warm = next((i for i, op in enumerate(ops) if op.kind != "F"), len(ops))
        assert warm == min(p - r, m)  # P-1-r warm-up forwards, then the first steady F
        assert t.peak_activations[r] == min(p - r, m)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 16), m=st.integers(1, 64))
def test_zb1p_defers_w_by_rank(p, m):
    s = pp.build("zb1p", p, m)
    t = pp.simulate(s, F=1.0, B=2.0, W=1.0)
    for r, ops in enumerate(s.ops):
        kinds = [op.kind for op in ops]
        assert kinds.count("I") == kinds.count("W") == m
        assert "B" not in kinds
        first_w = kinds.index("W")
        assert kinds[:first_w].count("I") == min(r + 1, m)
        # P-1-r warm-up F, the first steady F, then r more F before the first W frees one:
        # activations live until their W, so every rank holds min(P, m) (ZB-H1's memory)
        assert kinds[:first_w].count("F") == min(p, m)
        assert t.peak_activations[r] == min(p, m)


@pytest.mark.parametrize("bad", [
    dict(name="pipedream", num_ranks=4, num_microbatches=8),
    dict(name="1f1b", num_ranks=0, num_microbatches=8),
    dict(name="1f1b", num_ranks=4, num_microbatches=0),
    dict(name="1f1b", num_ranks=True, num_microbatches=8),
    dict(name="1f1b", num_ranks=2.0, num_microbatches=8),
    dict(name="1f1b", num_ranks=4, num_microbatches=8, num_stages_per_rank=2),
    dict(name="interleaved-1f1b", num_ranks=4, num_microbatches=8, num_stages_per_rank=0),
    dict(name="interleaved-1f1b", num_ranks=4, num_microbatches=6, num_stages_per_rank=2),
])
def test_bad_inputs_raise_value_error(bad):
    with pytest.raises(ValueError) as err:
        pp.build(**bad)
    msg = str(err.value)
    assert any(word in msg for word in ("unknown", "num_ranks", "num_microbatches", "num_stages_per_rank", "option"))
