"""The client-side router of multi-process PD serving (pdjax.disagg.router), on its own (no
process started): the cluster tests reach it only through the launcher, where a request sent
to a wrong instance, a re-issue that repeats or drops tokens, or a lost count is silent as
long as every request still ends."""

import pytest

from pdjax.disagg.router import Router, Tracked, least_loaded


def _tracked(n):
    return [Tracked(i, {"op": "generate", "prompt": [i]}) for i in range(n)]


def test_least_loaded_skips_down_instances_and_breaks_ties_by_index():
    """The live instance with the fewest unfinished requests, the lowest index on a tie; an
    instance that is down (None) is never picked, whatever its position."""
    assert least_loaded([3, None, 1, 1]) == 2
    assert least_loaded([None, 4, 2]) == 2 and least_loaded([0]) == 0
    assert least_loaded([None]) is None and least_loaded([]) is None


def test_a_fresh_tracked_request_and_router_hold_nothing():
    """A new Tracked has no instance, wire id, tokens, time, re-issue or result; a new Router
    has every instance down, nothing served, and sends nothing until an instance is up (the
    queue is kept, and the policy is asked once, not in a loop)."""
    r = Tracked(7, {"op": "generate"})
    assert (r.instance, r.wire_id, r.tokens, r.streamed, r.ttft, r.reissued, r.done) == (None, None, [], 0, None, 0, None)
    asked = []

    def policy(loads):
        asked.append(list(loads))
        if len(asked) > 3:
            raise AssertionError("the policy is asked again and again while every instance is down")
        return least_loaded(loads)
    router = Router(2, policy)
    assert router.live == [False, False] and router.served == [0, 0] and router.loads() == [None, None]
    router.submit(_tracked(2))
    assert router.assign() == [] and len(router.queue) == 2 and asked == [[None, None]]


def test_assign_alternates_equal_instances_with_fresh_wire_ids_in_queue_order():
    """Requests go out in the order submitted, each with the next wire id (from ``first_id``,
    0 by default) added to its message, to the least-loaded live instance; loads count only
    unfinished requests, and ``finish`` counts what each instance served."""
    router = Router(2)
    router.up(0)
    router.up(1)
    reqs = _tracked(3)
    router.submit(reqs)
    sent = router.assign()
    assert sent == [(0, {"op": "generate", "prompt": [0], "request": 0}),
                    (1, {"op": "generate", "prompt": [1], "request": 1}),
                    (0, {"op": "generate", "prompt": [2], "request": 2})]
    assert [(r.instance, r.wire_id) for r in reqs] == [(0, 0), (1, 1), (0, 2)] and router.queue == []
    assert router.loads() == [2, 1] and router.get(1) is reqs[1] and router.get(9) is None
    router.finish(reqs[0], {"op": "done"})
    assert reqs[0].done == {"op": "done"} and router.loads() == [1, 1] and router.served == [1, 0]
    router.finish(reqs[1], {"op": "done"})
    router.finish(reqs[2], {"op": "done"})
    assert router.loads() == [0, 0] and router.served == [2, 1]
    router.forget(reqs[:2])
    assert router.get(0) is None and router.get(1) is None and router.get(2) is reqs[2]
    other = Router(1, first_id=100)
    other.up(0)
    other.submit(_tracked(1))
    assert other.assign()[0][1]["request"] == 100


def test_tokens_stream_once_across_a_reissue():
    """``token`` returns True only for a token new to the client and keeps the first token's
    time; after ``lost`` re-issues the request, the tokens already streamed are received
    again but not streamed again, and only the later ones are."""
    router = Router(2)
    router.up(0)
    router.up(1)
    (r,) = reqs = _tracked(1)
    router.submit(reqs)
    router.assign()
    assert [router.token(r, t, now) for t, now in ((5, 1.0), (6, 2.0))] == [True, True]
    assert r.ttft == 1.0 and r.streamed == 2 and r.tokens == [5, 6]
    assert router.lost(0) == [r] and r.tokens == [] and r.reissued == 1
    router.assign()
    assert [router.token(r, t, 9.0) for t in (5, 6, 7)] == [False, False, True]
    assert r.streamed == 3 and r.ttft == 1.0 and r.tokens == [5, 6, 7]


def test_lost_requeues_only_the_unfinished_requests_of_that_instance_first():
    """``lost(k)``: instance k is down; its unfinished requests (not its finished ones, not
    another instance's) lose their instance and wire id, count a re-issue, and go to the
    front of the queue, in the order they were sent; the next ``assign`` sends them with new
    wire ids to a live instance, the old ids unknown."""
    router = Router(3)
    for k in range(3):
        router.up(k)
    reqs = _tracked(6)
    router.submit(reqs)
    router.assign()                     # instances 0, 1, 2, 0, 1, 2
    router.finish(reqs[1], {"op": "done"})
    later = _tracked(1)
    router.submit(later)                # queued, not sent yet: behind the lost ones below
    again = router.lost(1)
    assert again == [reqs[4]] and router.live == [True, False, True]
    assert (reqs[4].instance, reqs[4].wire_id, reqs[4].reissued) == (None, None, 1)
    assert reqs[1].reissued == 0 and reqs[1].instance == 1 and router.get(1) is reqs[1]
    assert [r.reissued for r in reqs] == [0, 0, 0, 0, 1, 0]
    assert router.queue == [reqs[4]] + later and router.get(4) is None
    assert router.loads() == [2, None, 2]
    sent = router.assign()
    assert [(k, m["request"]) for k, m in sent] == [(0, 6), (2, 7)]
    assert reqs[4].wire_id == 6 and router.get(6) is reqs[4]
    assert router.lost(1) == [] and router.lost(0) == [reqs[0], reqs[3], reqs[4]]
    assert [r.reissued for r in reqs] == [1, 0, 0, 1, 2, 0]


@pytest.mark.parametrize("pick", [-1, 2, "down"])
def test_a_policy_that_picks_no_live_instance_is_refused(pick):
    """A policy's pick outside the instances, or a down one, raises ValueError naming it
    (never an IndexError, never a request sent to a dead instance)."""
    router = Router(2, lambda loads: 1 if pick == "down" else pick)
    router.up(0)
    router.submit(_tracked(1))
    with pytest.raises(ValueError, match="routing policy picked instance"):
        router.assign()
    assert router.by_wire == {}
