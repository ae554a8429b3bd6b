"""The step accounting of pdjax.pipeline.RankProcesses and its workers
(pdjax.pipeline.rank_worker): the agreed start instant, the timeline's origin and units, the
transfer records, and what an isolated step adds. test_processes.py checks the step's
numbers (loss, gradients) and the timeline's dependencies, which hold whatever the origin,
the start instant or the units of the transfer records."""

import time

import numpy as np
import pytest

import pdjax.pipeline as pp


@pytest.fixture(scope="module")
def ranks(exec_cfg, exec_params):
    """Interleaved 1F1B on 2 rank processes: 4 stages, two per rank (test_processes.py runs
    zero-bubble, one stage per rank), so every value crosses between the processes."""
    rp = pp.RankProcesses(pp.build("interleaved-1f1b", 2, 4), exec_cfg, params=exec_params, timeout_s=120)
    yield rp
    rp.close()


def _transfers_within(transfers, before, after):
    """Every received value's record in ms of the machine's one clock, inside [before, after]
    (s): sent, then landed; its latency (in flight) at most landed - sent."""
    for t in transfers:
        assert before * 1e3 <= t["sent"] <= t["landed"] <= after * 1e3, t
        assert 0 <= t["latency"] <= t["landed"] - t["sent"] + 1e-6, t


def test_a_step_starts_at_the_agreed_instant_and_its_records_share_one_clock(ranks, exec_cfg, exec_tokens):
    """``step(lead_s=...)``: no worker starts its first op before the agreed instant (no
    value is sent before it, the step takes at least ``lead_s``); the timeline starts at 0 ms
    and ends within the step's wall time; each transfer record (one per value crossing: 4
    activation and one gradient of [rows, T, D] float32 per stage boundary and micro-batch)
    is in ms on the one clock; the per-stage memory is summed over the ranks stage by stage
    (each rank holding two stages) and gives the measured peaks."""
    ranks.step(exec_tokens)                                     # compiled and warm
    lead = 0.8
    before = time.perf_counter()
    ranks.step(exec_tokens, lead_s=lead)
    after = time.perf_counter()
    assert after - before >= lead
    tl = ranks.last_timeline
    assert min(float(np.min(s)) for s in tl.starts) == 0.0
    assert all((e > s).all() for s, e in zip(tl.starts, tl.ends))
    assert max(float(np.max(e)) for e in tl.ends) <= (after - before - lead) * 1e3
    tr, sched = ranks.transfers, ranks.schedule
    _transfers_within(tr, before + lead, after)
    M, (stages,) = sched.num_microbatches, [p.stages for p in sched.layout.pipelines]
    cross = sum(sched.layout.stage_rank[a] != sched.layout.stage_rank[b] for a, b in zip(stages, stages[1:]))
    rows, T = exec_tokens.shape[0] // M, exec_tokens.shape[1]
    assert len(tr) == 2 * cross * M and all(t["nbytes"] == rows * T * exec_cfg.hidden_size * 4 for t in tr), tr
    assert sorted(int(t["key"][2]) for t in tr) == sorted(list(range(M)) * 2 * cross)
    assert all(v.shape == (sched.num_stages,) for v in ranks.stage_memory.values())
    assert (ranks.stage_memory["F"] > 0).all()
    np.testing.assert_array_equal(ranks.last_memory, pp.simulate(sched, memory=ranks.stage_memory).peak_memory)


def test_transfer_latency_is_the_time_in_flight(ranks, exec_tokens):
    """With the "transfer" transport a value is pulled on arrival: its latency is exactly
    landed - sent (ms)."""
    ranks.transport = "transfer"
    try:
        before = time.perf_counter()
        ranks.step(exec_tokens)
        after = time.perf_counter()
    finally:
        ranks.transport = "shm"
    _transfers_within(ranks.transfers, before, after)
    for t in ranks.transfers:
        assert abs(t["latency"] - (t["landed"] - t["sent"])) < 1e-6, t


def test_only_an_isolated_step_measures_dispatch(ranks, exec_tokens):
    """A step is not isolated by default (no dispatch times); an isolated one has one per op."""
    ranks.step(exec_tokens)
    assert ranks.last_dispatch.size == 0
    ranks.step(exec_tokens, isolated=True)
    n_ops = sum(len(ops) for ops in ranks.schedule.ops)
    assert ranks.last_dispatch.shape == (n_ops,) and (ranks.last_dispatch > 0).all()
