"""Op text form and torch CSV import/export."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdjax.schedules as pp
from pdjax.schedules.comms import CommAction, comm_volume
from pdjax.schedules.ops import B, Op, OverlapFB, parse_op


@pytest.mark.parametrize("text", ["0F3", "1I0", "2W5", "3B1", "(0F7;7B3)OVERLAP_F_B", "(2F1;2I0)OVERLAP_F_B"])
def test_op_text_round_trip(text):
    assert str(parse_op(text)) == text


@pytest.mark.parametrize("cell", ["0X3", "F3", "0F", "(0F1)OVERLAP_F_B", "(0B1;0F1)OVERLAP_F_B",
                                  "(0F1;0W1)OVERLAP_F_B", "0F-1", "0SEND_F1", "abc"])
def test_malformed_cell_names_rank_and_cell(cell):
    text = "0F0,0B0\n" + f"1F0,{cell},1B0\n"
    with pytest.raises(ValueError, match=r"rank 1, cell 1"):
        pp.Schedule.from_csv(text)


def test_op_fields_are_checked():
    with pytest.raises(ValueError, match="kind"):
        Op("Q", 0, 0)
    with pytest.raises(ValueError, match="stage"):
        Op("F", -1, 0)
    with pytest.raises(ValueError, match="forward"):
        OverlapFB(B(0, 0), B(0, 1))


NAMES = ["gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipe", "dualpipev"]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(NAMES), ranks=st.integers(1, 8), k=st.integers(1, 4))
def test_csv_round_trip(name, ranks, k):
    if name == "dualpipe":
        ranks += ranks % 2
    m = 2 * ranks * k
    s = pp.build(name, ranks, m)
    text = s.to_csv()
    assert len(text.splitlines()) == s.num_ranks
    layout = s.layout if name == "dualpipe" else None  # torch's CSV holds one chain; DualPipe has two
    back = pp.Schedule.from_csv(text, layout=layout)
    assert back.ops == s.ops
    assert back.layout.stage_rank == s.layout.stage_rank


def test_csv_accepts_torch_idle_cells_and_crlf():
    s = pp.build("1f1b", 2, 2)
    rows = [",".join(["", *map(str, ops)]) for ops in s.ops]
    back = pp.Schedule.from_csv("\r\n".join(rows) + "\r\n")
    assert back.ops == s.ops


def test_csv_stage_on_two_ranks_is_an_error():
    with pytest.raises(ValueError, match=r"rank 1 op #0 0F1: stage 0 already appears on rank 0"):
        pp.Schedule.from_csv("0F0,0B0\n0F1,0B1\n")


def test_csv_missing_stage_and_empty():
    with pytest.raises(ValueError, match="appear in no row"):
        pp.Schedule.from_csv("0F0,0B0\n2F0,2B0\n")
    with pytest.raises(ValueError, match="no rows"):
        pp.Schedule.from_csv("\n\n")


def test_csv_impossible_order_names_rank_and_op():
    # rank 1 runs its backward before its forward
    with pytest.raises(ValueError, match=r"rank 1 op #0 1B0: backward .* before its forward"):
        pp.Schedule.from_csv("0F0,0B0\n1B0,1F0\n")


def test_derived_comms_match_between_ranks():
    for s in (pp.build("dualpipe", 4, 8), pp.build("dualpipev", 3, 6), pp.build("interleaved-1f1b", 3, 6)):
        sends, recvs = set(), set()
        for r, actions in enumerate(s.comms()):
            for a in actions:
                if isinstance(a, CommAction):
                    (sends if a.kind.startswith("SEND") else recvs).add((a.kind[-1], r, a.peer, a.microbatch))
        assert {(k, peer, r, m) for k, r, peer, m in sends} == recvs
    # DualPipeV's turn (stage N-1 -> N on the last rank) is local: no comm on that hop
    v = pp.build("dualpipev", 3, 6)
    last = v.comms()[2]
    assert not [a for a in last if isinstance(a, CommAction) and a.peer == 2]
    vol = comm_volume(v)
    assert vol[2]["SEND_F"] == 6 and vol[2]["RECV_F"] == 6  # one in (stage 2), one out (stage 3) per mb


def test_a_schedule_from_lists_equals_its_csv_round_trip_through_a_file(tmp_path):
    """Ops given as lists are stored as tuples; name and options say where a schedule came
    from, not what it is, so the round trip (text or a file path) gives an equal schedule."""
    from pdjax.schedules import Layout, Schedule
    from pdjax.schedules.ops import B, F

    s = Schedule("mine", Layout.chain([0, 1], 1), [[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]])
    assert isinstance(s.ops, tuple) and all(isinstance(r, tuple) for r in s.ops)
    assert Schedule.from_csv(s.to_csv(), layout=s.layout) == s
    path = tmp_path / "mine.csv"
    assert s.to_csv(path) == path.read_text()
    assert Schedule.from_csv(path, layout=s.layout) == s == Schedule.from_csv(str(path), layout=s.layout)
    assert len(repr(s)) < 100 and len(repr(pp.simulate(pp.build("dualpipe", 8, 20)))) < 1000


def test_a_huge_microbatch_id_is_refused_before_anything_is_sized_by_it():
    """'0F999999999' once made the validator allocate in proportion to the id (killed at 23 GB)."""
    with pytest.raises(ValueError, match=r"micro-batch id 999999999, but 4 ops cannot hold"):
        pp.Schedule.from_csv("0F0,0B0,0F999999999,0B999999999\n")
