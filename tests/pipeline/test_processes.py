"""A pipeline rank per process (pdjax.pipeline.RankProcesses): the same exact step as the
in-process executor, timelines on one clock, isolation across processes, both transports,
and failures that stop every worker."""

import os
import signal
import time

import jax
import numpy as np
import pytest

import pdjax.pipeline as pp
from timeline_checks import check_dependencies as _check_dependencies, max_rel_err as _max_rel_err


@pytest.fixture(scope="module")
def ranks(exec_cfg, exec_params):
    """Zero-bubble (F, I, W) on 2 rank processes: activations and gradients cross between
    the processes both ways."""
    rp = pp.RankProcesses(pp.build("zb1p", 2, 4), exec_cfg, params=exec_params, timeout_s=120)
    yield rp
    rp.close()


def test_rank_processes_step_equals_value_and_grad(ranks, exec_params, exec_tokens, exec_reference):
    ref_loss, ref_grads = exec_reference
    loss = ranks.step(exec_tokens)
    grads = ranks.grads()
    assert jax.tree.structure(grads) == jax.tree.structure(exec_params)
    assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert _max_rel_err(grads, ref_grads) <= 1e-5


def test_rank_processes_consecutive_steps_each_equal_value_and_grad(ranks, exec_cfg, exec_params, exec_tokens):
    """Three steps in a row on different batches: each step's loss and gradients are that
    batch's alone (the gradient accumulator starts from zero every step, not from the last
    step's sums)."""
    f = jax.jit(jax.value_and_grad(pp.next_token_loss), static_argnums=1)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, exec_cfg.vocab_size, exec_tokens.shape, dtype=np.int32) for _ in range(2)]
    for step, tokens in enumerate(batches + [exec_tokens]):
        ref_loss, ref_grads = f(exec_params, exec_cfg, tokens)
        loss = ranks.step(tokens)
        assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), step
        assert _max_rel_err(ranks.grads(), ref_grads) <= 1e-5, step


def test_rank_processes_timeline_and_memory(ranks, exec_tokens):
    ranks.step(exec_tokens)
    tl = ranks.last_timeline
    assert _check_dependencies(tl) == 8          # 4 activations and 4 gradients crossed, on one clock
    assert ranks.transfers and all(t["nbytes"] > 0 for t in ranks.transfers)
    sim = pp.simulate(ranks.schedule, memory=ranks.stage_memory)
    np.testing.assert_array_equal(ranks.last_memory, sim.peak_memory)


def test_rank_processes_isolated_ops_never_overlap(ranks, exec_tokens):
    """measure_ops runs one op at a time over every process (a lock shared by them)."""
    ranks.step(exec_tokens, isolated=True)
    tl = ranks.last_timeline
    spans = sorted((s, e) for r in range(tl.schedule.num_ranks) for s, e in zip(tl.starts[r], tl.ends[r]))
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), "two ranks ran ops at once"
    costs = ranks.measure_ops(exec_tokens, repeats=1)
    keys = {costs.key(op) for ops in ranks.schedule.ops for op in ops}
    assert keys == set(costs.durations) and all(v > 0 for v in costs.durations.values())
    assert 0 <= ranks.comm_ms < 1e3


def test_rank_processes_transfer_transport(ranks, exec_tokens, exec_reference):
    """The same step with values pulled over jax.experimental.transfer."""
    ranks.transport = "transfer"
    try:
        loss = ranks.step(exec_tokens)
        assert all("latency" in t for t in ranks.transfers) and ranks.transfers
    finally:
        ranks.transport = "shm"
    assert abs(loss - float(exec_reference[0])) <= 1e-5 * abs(float(exec_reference[0]))
    assert _max_rel_err(ranks.grads(), exec_reference[1]) <= 1e-5


def test_rank_processes_bad_input(ranks, exec_cfg, exec_tokens):
    s = pp.build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="not available"):
        pp.RankProcesses(s, exec_cfg, cores=[0, 4096])
    with pytest.raises(ValueError, match="one core per rank"):
        pp.RankProcesses(s, exec_cfg, cores=[0])
    with pytest.raises(ValueError, match="transport"):
        pp.RankProcesses(s, exec_cfg, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="does not split into"):
        ranks.step(exec_tokens[:3])
    assert all(c is None for c in ranks.procs.poll())     # a bad batch never reached them


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rank_processes_dead_worker_fails_fast(ranks, exec_tokens):
    """A worker killed mid-session: the next step fails at once (not at the timeout),
    naming the rank, and every worker is gone. (Last: it ends the module's processes.)"""
    pids = [ranks.procs.pid(r) for r in range(len(ranks.procs))]
    os.kill(pids[1], signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        ranks.step(exec_tokens)
    assert time.monotonic() - t < 60 < ranks.timeout_s
    assert ranks.procs is None and all(_gone(pid) for pid in pids)


def test_an_error_waits_briefly_for_a_peer_death_that_is_its_cause():
    """A worker killed mid-step closes its sockets before its exit can be seen: a peer's
    'connection reset' may come first. The error path waits (boundedly) to see a death, so
    the dead rank is named, not the peer that noticed it; with no death it gives up after
    the grace, not at the step's timeout."""
    from pdjax.pipeline import processes

    class Lagging:                       # rank 1's exit becomes visible 0.3 s after the first look
        def __init__(self, lag):
            self.first, self.lag = None, lag

        def exited(self):
            now = time.monotonic()
            self.first = self.first or now
            return [1] if self.lag is not None and now - self.first >= self.lag else []

        def close(self):
            pass
    rp = object.__new__(processes.RankProcesses)     # only its error path: no workers, nothing to close
    rp._ctl, rp._dir = [], None
    rp.procs = Lagging(0.3)
    assert rp._peer_deaths(0) == [1]
    rp.procs = Lagging(None)
    t = time.monotonic()
    assert rp._peer_deaths(0) == []
    assert processes.PEER_DEATH_GRACE_S <= time.monotonic() - t < processes.PEER_DEATH_GRACE_S + 5
    rp.procs = None
