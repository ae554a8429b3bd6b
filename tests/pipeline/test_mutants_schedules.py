"""The dependency program of :mod:`pdjax.schedules.program` where its other tests leave it
unpinned: each op's requirement slice, and the deadlock message in full, for dense keys and
for keys renumbered because the micro-batch ids are far above the layout's (an unchecked
schedule). Found by mutation testing (docs/mutation.md)."""

import pytest

import pdjax.schedules as pp
from pdjax.schedules import Layout, Schedule
from pdjax.schedules.ops import B, F
from pdjax.schedules.program import compile_program


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipev"])
def test_each_ops_requirements_are_its_own_slice(name):
    """``requirements(rank, i)`` of every op, the last one included, is op i's own slice of
    the rank's requirement keys: the slices laid end to end give them all, once."""
    s = pp.build(name, 2, 4)
    program = compile_program(s)
    for r, ops in enumerate(s.ops):
        got = [k for i in range(len(ops)) for k in program.requirements(r, i)]
        assert got == list(program.req_key[r])


@pytest.mark.parametrize("m", [1, 10**6])
def test_a_deadlock_names_each_stuck_op_and_the_result_it_waits_for(m):
    """The deadlock message names, per stuck rank, its op, the kind, stage and micro-batch of
    the missing result and the rank that makes it; also when the micro-batch ids are far
    above the layout's and the program renumbers its keys (``m`` = 10**6)."""
    ops = ((F(0, 0), B(0, 0), F(0, m), B(0, m)), (F(1, 0), F(1, m), B(1, 0), B(1, m)))
    s = Schedule("t", Layout.chain(range(2), 2), ops)
    assert (compile_program(s).original_keys is not None) == (m > 1)
    with pytest.raises(pp.DeadlockError) as err:
        pp.simulate(s, check=False)
    assert str(err.value) == (
        "deadlock: the derived sends/receives cannot make progress: "
        "rank 0 is stuck at op #1 0B0 waiting for the input-grad backward of stage 1 micro-batch 0 (on rank 1), "
        "which never runs before it; "
        f"rank 1 is stuck at op #1 1F{m} waiting for the forward of stage 0 micro-batch {m} (on rank 0), "
        "which never runs before it")


def test_a_pipeline_entering_at_a_later_stage_pays_comm_both_ways():
    """A layout is free to number its stages: a pipeline that runs stage 1 (rank 1) before
    stage 0 (rank 0) pays ``comm`` for the activation sent to stage 0 and for the gradient
    sent back from stage 0 to stage 1."""
    from pdjax.schedules.layout import Pipeline

    layout = Layout(2, (0, 1), (Pipeline((1, 0), 0, 1),))
    s = Schedule("t", layout, ((F(0, 0), B(0, 0)), (F(1, 0), B(1, 0))))
    t = pp.simulate(s, F=1.0, B=2.0, comm=0.5)
    assert [list(t.starts[0]), list(t.starts[1])] == [[1.5, 2.5], [0.0, 5.0]]
    assert t.makespan == 7.0
