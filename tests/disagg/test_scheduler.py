"""The decode scheduler as a state machine (a fake pool; the only jax is the checksum
comparison): random arrivals, prefill progress, failures, corrupt payloads, stale messages
of abandoned attempts, timeouts and decode steps (some failing slots). Every request ends exactly once, tokens
are never lost or duplicated, blocks are never leaked or freed twice, a layer is never
written into a cancelled or running reservation, and a corrupt attempt is never admitted."""

import math

import jax.numpy as jnp
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdjax.disagg.request import Request, RequestError
from pdjax.disagg.scheduler import (CancelPrefill, Compiling, DecodeScheduler, Failed, Finished, LayerArrived, Ready,
                                    Started, StartPrefill, Stepped, Submit, Tick, Token)

LAYERS, BLOCK, STOP = 3, 8, 99


def fake_checksum(rows):
    """The fake pool's rows are a row count: its checksum, as a device array like link.checksum's."""
    return jnp.array([rows, 7], jnp.uint32)


class FakeReservation:
    def __init__(self, request, blocks):
        self.request, self.blocks, self.layers = request, blocks, set()


class FakePool:
    """The pool protocol with strict bookkeeping: every misuse is an AssertionError."""

    def __init__(self, slots: int, blocks: int):
        self.free = set(range(blocks))
        self.total = blocks
        self.slot_req = [None] * slots
        self.pending: list = []

    def reserve(self, req):
        need = math.ceil((len(req.prompt) + req.max_new_tokens) / BLOCK)
        busy = sum(r is not None for r in self.slot_req) + len(self.pending)
        if busy >= len(self.slot_req) or len(self.free) < need:
            return None
        blocks = sorted(self.free)[:need]
        self.free -= set(blocks)
        res = FakeReservation(req, blocks)
        self.pending.append(res)
        return res

    def receive_layer(self, res, layer, rows, start):
        assert res in self.pending, "a layer written into a reservation that is not pending"
        assert rows == len(res.request.prompt) and start == 0
        res.layers.add(layer)

    def cancel(self, res):
        assert res in self.pending, "cancel of a reservation that is not pending"
        self.pending.remove(res)
        assert not self.free & set(res.blocks), "blocks freed twice"
        self.free |= set(res.blocks)

    def admit(self, res, first_token):
        assert res in self.pending and res.layers == set(range(LAYERS)), "admitted before every layer arrived"
        self.pending.remove(res)
        slot = self.slot_req.index(None)
        self.slot_req[slot] = res
        return slot

    def release(self, slot):
        res = self.slot_req[slot]
        assert res is not None, "release of an empty slot"
        assert not self.free & set(res.blocks), "blocks freed twice"
        self.free |= set(res.blocks)
        self.slot_req[slot] = None


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = FakePool(slots=3, blocks=12)
        self.s = DecodeScheduler(self.pool, max_prefill_attempts=3, handoff_timeout_s=5.0, checksum=fake_checksum)
        self.t = 0.0
        self.requests: list[Request] = []
        self.ended: dict[int, int] = {}             # request index -> Finished count
        self.tokens: dict[int, list] = {}           # request index -> Token actions
        self.flights: list = []                     # prefill side: [request, attempt, layers sent, cancelled]

    def _do(self, event):
        for a in self.s.handle(event):
            if isinstance(a, StartPrefill):
                self.flights.append([a.attempt.request.index, a.attempt.number, 0, False])
            elif isinstance(a, CancelPrefill):
                for f in self.flights:
                    if f[:2] == [a.request, a.attempt]:
                        f[3] = True                 # the prefill may still send late messages
            elif isinstance(a, Token):
                self.tokens.setdefault(a.request.index, []).append(a.token)
            elif isinstance(a, Finished):
                self.ended[a.request.index] = self.ended.get(a.request.index, 0) + 1

    @rule(prompt=st.integers(1, 40), new=st.integers(1, 4))
    def submit(self, prompt, new):
        req = Request(len(self.requests), [1] * prompt, new, stop_tokens=(STOP,))
        self.requests.append(req)
        self._do(Submit(req, self.t))

    @precondition(lambda self: self.flights)
    @rule(data=st.data())
    def prefill_progress(self, data):
        f = data.draw(st.sampled_from(self.flights))
        idx, n, sent, _ = f
        what = data.draw(st.sampled_from(["started", "layer", "failed", "fatal"]))
        if what == "started":
            self._do(Started(idx, n, self.t))
        elif what == "layer" and sent < LAYERS:
            f[2] += 1
            self._do(LayerArrived(idx, n, sent, len(self.requests[idx].prompt), 0, 10, self.t))
            if f[2] == LAYERS:                       # all sent: the prefill is ready
                self.flights.remove(f)
                T = len(self.requests[idx].prompt)
                corrupt = data.draw(st.sampled_from([None, 0, 1, 2]))       # a layer that arrived altered
                sums = [[l, 0, T + (l == corrupt), 7] for l in range(LAYERS)]
                current = idx in self.s.attempts and self.s.attempts[idx].number == n
                self._do(Ready(idx, n, data.draw(st.sampled_from([5, STOP])), self.t, checksums=sums))
                if corrupt is not None and current:
                    req = self.requests[idx]
                    assert all(r is None or r.request is not req for r in self.pool.slot_req), "corrupt admitted"
                    assert not req.output, "a token of a corrupt attempt"
        elif what in ("failed", "fatal"):
            self.flights.remove(f)
            self._do(Failed(idx, n, "link dropped", self.t, fatal=what == "fatal"))

    @rule(dt=st.floats(0.0, 8.0))
    def tick(self, dt):
        self.t += dt
        self._do(Tick(self.t))

    @precondition(lambda self: self.s.running)
    @rule(data=st.data())
    def step(self, data):
        failed = RequestError("the decode step failed this slot")       # e.g. an AFD FFN rank went down
        toks = {s: data.draw(st.sampled_from([7, STOP, failed])) for s, r in enumerate(self.pool.slot_req)
                if r is not None}
        self._do(Stepped(toks, self.t))

    @invariant()
    def each_request_ends_at_most_once_and_blocks_balance(self):
        assert all(c == 1 for c in self.ended.values()), "a request ended twice"
        assert self.s.remaining == len(self.requests) - len(self.ended)
        held = sum(len(r.blocks) for r in self.pool.pending) + sum(len(r.blocks) for r in self.pool.slot_req if r)
        assert held + len(self.pool.free) == self.pool.total, "blocks lost"
        # the pool holds exactly the reservations of the attempts in flight and of running requests
        assert {id(a.res) for a in self.s.attempts.values()} == {id(r) for r in self.pool.pending}, "blocks leaked"
        assert all(r.request.index not in self.ended for r in self.pool.slot_req if r), "an ended request holds a slot"

    @invariant()
    def tokens_are_neither_lost_nor_duplicated(self):
        for req in self.requests:
            assert self.tokens.get(req.index, []) == req.output
            if req.index in self.ended:
                if req.error is None:
                    assert len(req.output) == req.max_new_tokens or req.output[-1] == STOP
                else:
                    assert isinstance(req.error, RequestError)
            else:
                assert req.error is None and len(req.output) < req.max_new_tokens


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestScheduler = SchedulerMachine.TestCase


def test_scheduler_drains_every_request():
    """Driven to the end (every prefill succeeds after one failure and one timeout): every
    request ends once with its tokens and every block is free again."""
    pool = FakePool(slots=2, blocks=10)
    s = DecodeScheduler(pool, max_prefill_attempts=3, handoff_timeout_s=1.0)
    reqs = [Request(i, [1] * (5 + 7 * i), 3) for i in range(5)]
    t, flights, ended = 0.0, [], []

    def do(ev):
        for a in s.handle(ev):
            if isinstance(a, StartPrefill):
                flights.append((a.attempt.request.index, a.attempt.number))
            elif isinstance(a, Finished):
                ended.append(a.request.index)
    for r in reqs:
        do(Submit(r, t))
    assert len(flights) == 2 and len(s.waiting) == 3          # back-pressure: two slots
    for _ in range(200):                                           # bounded: a stuck machine fails
        if not s.remaining:
            break
        t += 0.1
        if flights:
            idx, n = flights.pop(0)
            if n == 1 and idx == 0:
                do(Failed(idx, n, "link dropped", t))
                continue
            do(Started(idx, n, t))
            if n == 1 and idx == 1:                                # stalls past the deadline
                t += 2.0
                do(Tick(t))
                do(LayerArrived(idx, n, 0, len(reqs[idx].prompt), 0, 10, t))   # late: stale
                continue
            for layer in range(LAYERS):
                do(LayerArrived(idx, n, layer, len(reqs[idx].prompt), 0, 10, t))
            do(Ready(idx, n, 5, t))
        if s.running:
            do(Stepped({k: 7 for k, r in enumerate(pool.slot_req) if r is not None}, t))
    assert sorted(ended) == list(range(5)) and len(pool.free) == 10
    assert all(r.output == [5, 7, 7] and r.error is None for r in reqs)
    assert [r.prefill_attempts for r in reqs] == [2, 2, 1, 1, 1]
    assert reqs[1].handoff_timeouts == 1 and s.stats["handoff_timeouts"] == 1 and s.stats["stale_messages"] == 1
    assert s.stats["pool_full"] > 0 and [r.reserve_wait_s > 0 for r in reqs] == [False, False, True, True, True]
    assert [r.kv_bytes_sent for r in reqs] == [10 * LAYERS] * 5          # the completing attempt's only


def test_scheduler_bad_arguments():
    with pytest.raises(ValueError, match="max_prefill_attempts"):
        DecodeScheduler(FakePool(1, 1), max_prefill_attempts=0)
    with pytest.raises(ValueError, match="handoff_timeout_s"):
        DecodeScheduler(FakePool(1, 1), handoff_timeout_s=0)


def test_retried_attempts_bytes_and_counters_are_exact():
    """Mutation-testing gaps (docs/mutation.md): an attempt that sent layers and then failed
    takes its bytes back (kv_bytes_sent counts the completing attempt only), and each counter
    starts at 0 and counts one per event."""
    pool = FakePool(slots=1, blocks=10)
    s = DecodeScheduler(pool, max_prefill_attempts=3, checksum=fake_checksum)
    assert s.stats == dict.fromkeys(["handoff_timeouts", "stale_messages", "pool_full", "corrupt_payloads",
                                     "malformed_payloads"], 0)
    req = Request(0, [1] * 5, 2)
    actions = s.handle(Submit(req, 0.0))
    assert [a.attempt.number for a in actions if isinstance(a, StartPrefill)] == [1]
    s.handle(Started(0, 1, 0.1))
    for layer in range(2):                                     # two layers, then the link drops
        s.handle(LayerArrived(0, 1, layer, 5, 0, 10, 0.2))
    assert req.kv_bytes_sent == 20
    s.handle(Failed(0, 1, "link dropped", 0.3))
    assert req.kv_bytes_sent == 0
    for n, corrupt in ((2, 1), (3, None)):                     # attempt 2 arrives altered, 3 intact
        s.handle(Started(0, n, 0.4))
        for layer in range(LAYERS):
            s.handle(LayerArrived(0, n, layer, 5, 0, 10, 0.5))
        s.handle(Ready(0, n, 7, 0.6, checksums=[[l, 0, 5 + (l == corrupt), 7] for l in range(LAYERS)]))
    assert req.kv_bytes_sent == 10 * LAYERS and req.prefill_attempts == 3 and req.error is None
    assert s.stats == {"handoff_timeouts": 0, "stale_messages": 0, "pool_full": 0, "corrupt_payloads": 1,
                       "malformed_payloads": 0}


def test_a_failed_decode_slot_ends_its_request_with_the_error():
    """Mutation-testing gap (docs/mutation.md): the step's RequestError becomes the request's
    error (not a normal finish), its slot is freed and the other slot's token stands."""
    pool = FakePool(slots=2, blocks=10)
    s = DecodeScheduler(pool)
    reqs = [Request(i, [1] * 5, 3) for i in range(2)]
    for r in reqs:
        s.handle(Submit(r, 0.0))
        for layer in range(LAYERS):
            s.handle(LayerArrived(r.index, 1, layer, 5, 0, 10, 0.1))
        s.handle(Ready(r.index, 1, 5, 0.2))
    slot = {res.request.index: k for k, res in enumerate(pool.slot_req)}
    err = RequestError("the decode step failed this slot")
    out = s.handle(Stepped({slot[0]: err, slot[1]: 7}, 0.3))
    assert [a.request.index for a in out if isinstance(a, Finished)] == [0]
    assert reqs[0].error is err and reqs[0].finish_time is None and reqs[0].output == [5]
    assert reqs[1].error is None and reqs[1].output == [5, 7] and s.remaining == 1
    assert pool.slot_req[slot[0]] is None and pool.slot_req[slot[1]] is not None


def _prefill(s, idx, n, t, layers=range(LAYERS), rows=5, first=5, checksums=None):
    """The prefill side of one attempt: its layers (10 bytes each), then Ready; the actions."""
    out = []
    for layer in layers:
        out += s.handle(LayerArrived(idx, n, layer, rows, 0, 10, t))
    return out + s.handle(Ready(idx, n, first, t, checksums=checksums))


def test_deadlines_pause_while_compiling_and_expire_only_past_the_deadline():
    """Mutation-testing gaps (docs/mutation.md): no deadline while queued at the prefill or
    compiling; otherwise ``last progress + handoff_timeout_s``, and an attempt is abandoned
    only strictly past it; every timeout and every late message is counted."""
    s = DecodeScheduler(FakePool(slots=1, blocks=10), handoff_timeout_s=2.0)
    req = Request(0, [1] * 5, 2)
    s.handle(Submit(req, 0.0))
    assert s.deadline() == math.inf                            # queued at the prefill
    s.handle(Started(0, 1, 1.0))
    assert s.deadline() == 1.0 + 2.0
    s.handle(Compiling(0, 1, True, 1.5))
    assert s.deadline() == math.inf and s.handle(Tick(100.0)) == []
    s.handle(Compiling(0, 1, False, 100.0))                   # compiled: the deadline restarts
    assert s.deadline() == 100.0 + 2.0
    assert s.handle(Tick(102.0)) == []                        # at the deadline, not past it
    out = s.handle(Tick(102.5))
    assert [type(a) for a in out] == [CancelPrefill, StartPrefill] and out[1].attempt.number == 2
    for _ in range(2):                                         # attempt 1's late layers: stale
        assert s.handle(LayerArrived(0, 1, 0, 5, 0, 10, 103.0)) == []
    s.handle(Started(0, 2, 103.0))
    assert [type(a) for a in s.handle(Tick(105.5))] == [CancelPrefill, StartPrefill]
    assert req.handoff_timeouts == 2 and req.kv_bytes_sent == 0
    assert s.stats["handoff_timeouts"] == 2 and s.stats["stale_messages"] == 2


def test_failures_end_a_request_after_max_prefill_attempts_or_at_once_when_fatal():
    """Mutation-testing gaps (docs/mutation.md): by default a request is prefilled at most 3
    times, then ends with a RequestError naming the count and the last reason; a fatal
    failure ends it at once with its own reason; one attempt is a valid limit."""
    s = DecodeScheduler(FakePool(slots=2, blocks=20))
    req, bad = Request(0, [1] * 5, 2), Request(1, [1] * 5, 2)
    started = [a.attempt.number for a in s.handle(Submit(req, 0.0)) if isinstance(a, StartPrefill)]
    for n in (1, 2, 3):
        out = s.handle(Failed(0, n, "link dropped", float(n)))
        started += [a.attempt.number for a in out if isinstance(a, StartPrefill)]
    assert started == [1, 2, 3] and req.prefill_attempts == 3
    assert [a.request for a in out if isinstance(a, Finished)] == [req]
    assert isinstance(req.error, RequestError) and "failed 3 times: link dropped" in str(req.error)
    assert req.finish_time is None
    s.handle(Submit(bad, 4.0))
    out = s.handle(Failed(1, 1, "prompt too long", 4.0, fatal=True))
    assert [type(a) for a in out] == [Finished] and str(bad.error) == "prompt too long"
    assert bad.prefill_attempts == 1 and s.remaining == 0 and not s.attempts
    once = DecodeScheduler(FakePool(slots=1, blocks=10), max_prefill_attempts=1)
    once.handle(Submit(Request(0, [1] * 5, 2), 0.0))
    assert [type(a) for a in once.handle(Failed(0, 1, "link dropped", 1.0))] == [Finished]


class PickyPool(FakePool):
    """A pool that refuses a payload of the wrong shape, as DecodePool does."""

    def receive_layer(self, res, layer, rows, start):
        if rows == "bad":
            raise ValueError("wrong shape")
        super().receive_layer(res, layer, rows, start)


def test_a_malformed_layer_fails_its_attempt_and_is_counted_once_each():
    """Mutation-testing gap (docs/mutation.md): a layer the pool refuses cancels its attempt
    (CancelPrefill, blocks freed, bytes not counted) and retries it; each is one
    ``malformed_payloads``; an intact attempt is then admitted."""
    pool = PickyPool(slots=1, blocks=10)
    s = DecodeScheduler(pool)
    req = Request(0, [1] * 5, 2)
    s.handle(Submit(req, 0.0))
    for n in (1, 2):
        out = s.handle(LayerArrived(0, n, 0, "bad", 0, 10, float(n)))
        assert [type(a) for a in out] == [CancelPrefill, StartPrefill] and out[0].attempt == n
    assert s.stats["malformed_payloads"] == 2 and req.kv_bytes_sent == 0 and req.error is None
    out = _prefill(s, 0, 3, 3.0)
    assert [type(a).__name__ for a in out] == ["Token", "Admitted"] and req.kv_bytes_sent == 10 * LAYERS


def test_unchecked_payloads_and_a_chunk_that_was_never_sent():
    """Mutation-testing gaps (docs/mutation.md): a Ready without checksums, or a scheduler
    without a checksum, is not checked; a chunk that arrived but is not among the sent
    checksums fails the attempt, naming its layer, and each such attempt counts once."""
    sums = [[layer, 0, 5, 7] for layer in range(LAYERS)]
    checked = DecodeScheduler(FakePool(slots=1, blocks=10), checksum=fake_checksum)
    checked.handle(Submit(Request(0, [1] * 5, 2), 0.0))
    for layer in range(LAYERS):
        checked.handle(LayerArrived(0, 1, layer, 5, 0, 10, 1.0))
    assert "Admitted" in [type(a).__name__ for a in checked.handle(Ready(0, 1, 5, 1.0))]   # no checksums
    unchecked = DecodeScheduler(FakePool(slots=1, blocks=10))
    unchecked.handle(Submit(Request(0, [1] * 5, 2), 0.0))
    wrong = [[layer, 0, 6, 7] for layer in range(LAYERS)]
    assert "Admitted" in [type(a).__name__ for a in _prefill(unchecked, 0, 1, 1.0, checksums=wrong)]
    s = DecodeScheduler(FakePool(slots=1, blocks=10), checksum=fake_checksum, max_prefill_attempts=2)
    req = Request(0, [1] * 5, 2)
    s.handle(Submit(req, 0.0))
    for n in (1, 2):                                           # layer 2 arrives, is not in the sums
        out = _prefill(s, 0, n, float(n), checksums=sums[:2])
    assert [type(a) for a in out] == [Finished] and s.stats["corrupt_payloads"] == 2
    assert str(req.error).endswith("failed 2 times: layer 2 arrived but was never sent")


def test_request_times_running_the_trace_and_abandon():
    """Mutation-testing gaps (docs/mutation.md): a request's reserve wait (submit to
    reservation), KV wait (reservation to Ready), first-token and finish times; ``running``
    is a bool property; the trace records each action and each refused reservation
    (``PoolFull``, one per event that finds the pool full, before that event's actions) with
    its time and request; ``abandon`` gives back every reservation and
    slot and forgets the waiting requests."""
    trace: list = []
    pool = FakePool(slots=1, blocks=10)
    s = DecodeScheduler(pool, trace=trace)
    r0, r1 = Request(0, [1] * 5, 3), Request(1, [1] * 5, 3)
    s.handle(Submit(r0, 1.0))
    s.handle(Submit(r1, 1.0))                                   # one slot: r1 waits
    assert s.running is False and s.stats["pool_full"] == 1
    _prefill(s, 0, 1, 1.5)
    assert s.running is True and s.stats["pool_full"] == 1 + LAYERS + 1   # refused at every event
    s.handle(Stepped({0: 7}, 2.0))
    s.handle(Stepped({0: 7}, 2.5))                             # r0 ends: r1 gets the slot
    assert r0.output == [5, 7, 7] and s.running is False
    assert (r0.reserve_wait_s, r0.kv_wait_s, r0.first_token_time, r0.finish_time) == (
        1.0 - 1.0, 1.5 - 1.0, 1.5, 2.5)
    assert r1.reserve_wait_s == 2.5 - 1.0
    assert trace == [(1.0, "StartPrefill", 0), (1.0, "PoolFull", 1)] + [(1.5, "PoolFull", 1)] * (LAYERS + 1) + [
        (1.5, "Token", 0), (1.5, "Admitted", 0), (2.0, "PoolFull", 1), (2.0, "Token", 0), (2.5, "Token", 0),
        (2.5, "Finished", 0), (2.5, "StartPrefill", 1)]
    pool = FakePool(slots=2, blocks=10)
    s = DecodeScheduler(pool)
    for i in range(3):                                          # running, in flight, waiting
        s.handle(Submit(Request(i, [1] * 5, 3), 0.0))
    _prefill(s, 0, 1, 0.5)
    assert s.running and len(s.attempts) == 1 and len(s.waiting) == 1
    s.abandon()
    assert len(pool.free) == 10 and pool.pending == [] and pool.slot_req == [None, None]
    assert not s.attempts and not s.waiting and s.running is False
