"""Validator: each broken rule is reported with its rank and op; deadlocks never hang."""

import pytest

import pdjax.schedules as pp
from pdjax.schedules import Layout, Schedule
from pdjax.schedules.ops import B, F, FB, I, W


def _chain(ops, m):
    return Schedule("t", Layout.chain(range(len(ops)), m), tuple(tuple(o) for o in ops))


def test_valid_hand_written():
    _chain([[F(0, 0), I(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]], 1).validate()


@pytest.mark.parametrize("ops,m,pattern", [
    ([[F(0, 0), B(0, 0)], [F(1, 0)]], 1, r"rank 1: stage 1 micro-batch 0 has no backward"),
    ([[F(0, 0), B(0, 0)], [B(1, 0)]], 1, r"rank 1 op #0 1B0: backward .* before its forward 1F0"),
    ([[F(0, 0), F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #1 0F0: second forward"),
    ([[F(0, 0), W(0, 0), I(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #1 0W0: W comes before"),
    ([[F(0, 0), B(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #2 0W0: .* full backward"),
    ([[F(0, 0), I(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0: stage 0 micro-batch 0 has 0I0 but no 0W0"),
    ([[F(1, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #0 1F0: stage 1 belongs to rank 1"),
    ([[F(0, 0), B(0, 0), F(0, 1)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #2 0F1: micro-batch 1 is not"),
    ([[F(0, 0), B(0, 0)], [F(5, 0)]], 1, r"rank 1 op #0 5F0: stage 5 does not exist"),
    ([[F(0, 0)], [FB(F(1, 0), B(1, 0))]], 1, r"rank 1 op #0 \(1F0;1B0\)OVERLAP_F_B: backward .* before"),
    ([[F(0, 0), B(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #2 0B0: second backward"),
    ([[F(0, 0), I(0, 0), B(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #2 0B0: second backward"),
    ([[F(0, 0), I(0, 0), W(0, 0), W(0, 0)], [F(1, 0), B(1, 0)]], 1, r"rank 0 op #3 0W0: second W"),
])
def test_broken_rules(ops, m, pattern):
    with pytest.raises(pp.ScheduleError, match=pattern):
        _chain(ops, m).validate()


def test_cross_rank_deadlock_is_reported_not_hung():
    # rank 1 runs 1F1 before 1B0, rank 0 runs 0B0 before 0F1: a cycle through the sends
    ops = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]]
    with pytest.raises(pp.DeadlockError, match=r"deadlock.*rank 0 is stuck at op #1 0B0.*rank 1 is stuck at op #1 1F1"):
        _chain(ops, 2).validate()


@pytest.mark.parametrize("rank,earlier,later", [(0, 0, 3), (1, 1, 2)])
def test_a_rank_running_its_earlier_stage_backward_first_is_refused(rank, earlier, later):
    """DualPipeV puts two stages of the V on each rank: rank 0 the first and the last, rank 1
    the two at the turn (next to each other: their values pass locally, with no send). For
    one micro-batch the later stage's backward must come before the earlier stage's (the
    gradient flows back through the V); running the earlier one first waits on a result
    that is not made yet, on this rank or through the others: refused, naming the op."""
    s = pp.build("dualpipev", 2, 4)
    assert s.layout.stage_rank[earlier] == s.layout.stage_rank[later] == rank
    ops = list(s.ops[rank])

    def backward(stage, m):   # a plain B or I op (not inside an overlapped pair)
        return next((i for i, op in enumerate(ops) if op.kind in ("B", "I") and op.stage == stage
                     and op.microbatch == m), None)
    m = next(m for m in range(4) if backward(later, m) is not None and backward(earlier, m) is not None)
    i_later, i_earlier = backward(later, m), backward(earlier, m)
    assert i_later < i_earlier                   # the valid order, before the swap
    ops[i_later], ops[i_earlier] = ops[i_earlier], ops[i_later]
    bad = Schedule("t", s.layout, tuple(ops if r == rank else o for r, o in enumerate(s.ops)))
    with pytest.raises((pp.ScheduleError, pp.DeadlockError), match=rf"rank {rank} .*op #{i_later} {earlier}[BI]{m}"):
        bad.validate()


def test_large_deadlock_is_fast():
    s = pp.build("1f1b", 16, 64)
    ops = [list(o) for o in s.ops]
    # move rank 0's first backward to the front of rank 0's program: needs grads not yet produced
    i = next(i for i, op in enumerate(ops[3]) if op.kind == "B")
    ops[3].insert(0, ops[3].pop(i))
    bad = Schedule("t", s.layout, tuple(map(tuple, ops)))
    with pytest.raises(pp.ScheduleError, match=r"rank 3 op #0 3B0"):
        bad.validate()


def test_schedule_rejects_wrong_rank_count():
    with pytest.raises(ValueError, match="rank programs"):
        Schedule("t", Layout.chain([0, 1], 1), ((F(0, 0), B(0, 0)),))


# Mutation-testing gaps (docs/mutation.md): the stage one past the last, the micro-batch range
# in the message, and the end-of-schedule counts read at a later stage and micro-batch.
def _gpipe_3(last_rank_ops):
    first = [F(0, 0), F(0, 1), F(0, 2), B(0, 0), B(0, 1), B(0, 2)]
    return _chain([first, last_rank_ops], 3)


def test_the_stage_one_past_the_last_is_a_schedule_error():
    with pytest.raises(pp.ScheduleError, match=r"rank 1 op #0 2F0: stage 2 does not exist"):
        _chain([[F(0, 0), B(0, 0)], [F(2, 0)]], 1).validate()


def test_an_out_of_range_microbatch_names_the_pipeline_range():
    with pytest.raises(pp.ScheduleError, match=r"micro-batch 3 is not in stage 1's pipeline \(micro-batches 0\.\.2\)"):
        _gpipe_3([F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2), F(1, 3)]).validate()


def test_counts_are_checked_at_a_later_stage_and_microbatch():
    _gpipe_3([F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2)]).validate()
    with pytest.raises(pp.ScheduleError, match=r"rank 1: stage 1 micro-batch 2 has 1I2 but no 1W2"):
        _gpipe_3([F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), I(1, 2)]).validate()
    with pytest.raises(pp.ScheduleError, match=r"rank 1: stage 1 micro-batch 2 has no forward \(expected op 1F2\)"):
        _gpipe_3([F(1, 0), B(1, 0), F(1, 1), B(1, 1)]).validate()
    with pytest.raises(pp.ScheduleError, match=r"rank 1: stage 1 micro-batch 2 has no backward"):
        _gpipe_3([F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2)]).validate()
