"""Faults injected at the KV link of an in-process PDEngine (tests/disagg/faults.py wraps
the engine's link; the clock is driven by hand, so nothing depends on wall-clock sleeps): a
failed transfer, a transfer stalled past its deadline, a corrupt layer payload, a prefill
worker that dies mid-transfer and a delayed transfer, each on its own request of one run.
Every request ends once with the tokens of pdjax.generate, each token streamed once, the
other requests untouched, and no KV block leaked."""

import collections

import jax
import pytest
from faults import (BAD_ARRIVALS, Fault, FaultyLink, ManualClock, assert_nothing_held, free_blocks,
                    generate_within, run_with_faults, run_with_hang)

from pdjax.disagg import ColocatedEngine, PDEngine, RequestError

ITEMSIZE = 4


@pytest.fixture(scope="module")
def engine(tiny_cfg, tiny_params):
    return PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                    prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                    max_context=256, handoff_timeout_s=1.0)


def test_every_link_fault_is_survived(engine, tiny_cfg, pd_prompts, pd_expected):
    clock = ManualClock()
    faults = [Fault("fail", request=0), Fault("stall", request=1, seconds=10.0),
              Fault("corrupt", request=2, layer=2), Fault("kill", request=3, layer=0),
              Fault("delay", request=4, seconds=0.5)]
    link = FaultyLink(engine.link, faults, clock=clock)
    streamed = collections.defaultdict(list)
    engine.link = link
    try:
        out = engine.generate(pd_prompts, max_new_tokens=5, clock=clock,
                              on_token=lambda i, t: streamed[i].append(t))
    finally:
        engine.link = link.inner
    assert sorted(k for k, *_ in link.fired) == ["corrupt", "delay", "fail", "kill", "stall"]
    assert out == pd_expected                                  # nothing lost
    assert dict(streamed) == dict(enumerate(pd_expected))      # nothing duplicated
    reqs, stats = engine.stats["requests"], engine.stats
    assert [r["prefill_attempts"] for r in reqs] == [2, 2, 2, 2] + [1] * (len(pd_prompts) - 4)
    assert [r["handoff_timeouts"] for r in reqs] == [0, 1] + [0] * (len(pd_prompts) - 2)
    assert stats["corrupt_payloads"] == 1 and stats["worker_restarts"] == 1 and stats["handoff_timeouts"] == 1
    # the delay (0.5 s, under the 1 s deadline) cost time, not an attempt
    assert reqs[4]["ttft"] >= 0.5
    # only the attempts that completed count: exactly the latent rows of every prompt
    assert [r["kv_bytes_sent"] for r in reqs] == [len(p) * tiny_cfg.kv_latent_dim * tiny_cfg.num_hidden_layers
                                                  * ITEMSIZE for p in pd_prompts]
    # every block is back, nothing is pending
    pool = engine.decode
    assert pool.pending == [] and all(r is None for r in pool.slot_req)
    assert [pool.alloc.available(k) for k in range(pool.ranks)] == [pool.alloc.num_blocks - 1] * pool.ranks


# ---- the engine survives payload and exchange faults (PD and colocated) -----------------------
@pytest.fixture(scope="module")
def colocated(tiny_cfg, tiny_params):
    return ColocatedEngine(tiny_params, tiny_cfg, devices=jax.devices()[:4], mesh={"expert": 4},
                           max_decode_slots=4, max_context=256, handoff_timeout_s=1.0)


@pytest.fixture(params=["pd", "colocated"])
def any_engine(request, engine, colocated):
    return engine if request.param == "pd" else colocated


# requests 0 and 1 are still decoding (40 tokens) when request 2's prefill sends
LONG = [40, 40, 5, 5]


def _first5(out):
    return [o[:5] for o in out]


def test_a_stalled_send_is_cancelled_by_its_deadline(any_engine, pd_prompts, pd_expected):
    """Request 2's layer-1 send stalls (and moves the clock 10 s past its 1 s deadline): the
    decode loop keeps stepping (requests 0 and 1 are decoding), the deadline cancels the send (the stall ends "cancelled", not
    after its 20 s of real waiting) and the request is prefilled again. A colocated engine
    held its pool lock across the send: the loop froze until the stall gave up."""
    free = free_blocks(any_engine)
    out, link = run_with_faults(any_engine, pd_prompts[:4], [Fault("stall", request=2, seconds=10.0, max_wait_s=20.0)], LONG)
    assert _first5(out) == pd_expected[:4]
    assert link.stall_ends == ["cancelled"]
    assert [r["handoff_timeouts"] for r in any_engine.stats["requests"]] == [0, 0, 1, 0]
    assert_nothing_held(any_engine, free)


def test_a_send_that_never_returns_fails_only_its_attempt(any_engine, pd_prompts, pd_expected):
    """Request 2's layer-1 send never returns (deaf to the cancel): its deadline fires, the
    prefill worker gets a fresh thread and the retry finishes while the first send still
    hangs; the other requests finish with the right tokens. (A watchdog releases the hang
    after 30 s, so a broken engine fails this test instead of hanging the suite.)"""
    free = free_blocks(any_engine)
    out, still_hanging = run_with_hang(any_engine, pd_prompts[:4], Fault("hang", request=2, seconds=10.0), LONG)
    assert still_hanging == 1 and _first5(out) == pd_expected[:4]
    reqs = any_engine.stats["requests"]
    assert [r["handoff_timeouts"] for r in reqs] == [0, 0, 1, 0]
    assert [r["prefill_attempts"] for r in reqs] == [1, 1, 2, 1]
    assert_nothing_held(any_engine, free)


@pytest.mark.parametrize("kind,says", [("extra_row", "outside its"), ("wrong_device", "expected on rank"),
                                       ("wrong_dtype", "payload dtype float16")])
def test_a_malformed_payload_fails_only_its_request(any_engine, pd_prompts, pd_expected, kind, says):
    """Every attempt of request 2 delivers a malformed layer 1 (one row too many, on another
    device, float16): the decode pool refuses it before writing, the attempt fails and is
    retried, and after its 3 attempts the request fails alone with the reason; the others
    finish with the right tokens, no block or reservation is left held, and the engine serves
    a clean run next. A payload spoiled once costs one retry only."""
    free = free_blocks(any_engine)
    out, _ = run_with_faults(any_engine, pd_prompts[:4], [Fault(kind, request=2, attempt=a) for a in (1, 2, 3)])
    assert isinstance(out[2], RequestError) and "malformed layer payload" in str(out[2]) and says in str(out[2])
    assert [o for i, o in enumerate(out) if i != 2] == [e for i, e in enumerate(pd_expected[:4]) if i != 2]
    assert any_engine.stats["malformed_payloads"] == 3
    assert_nothing_held(any_engine, free)
    out, _ = run_with_faults(any_engine, pd_prompts[:4], [Fault(kind, request=1)])
    assert out == pd_expected[:4] and any_engine.stats["malformed_payloads"] == 1
    assert [r["prefill_attempts"] for r in any_engine.stats["requests"]] == [1, 2, 1, 1]
    assert_nothing_held(any_engine, free)


@pytest.mark.parametrize("arrivals,says", BAD_ARRIVALS)
def test_bad_arrival_times_fail_before_any_compute(any_engine, pd_prompts, compile_counter, arrivals, says):
    """A NaN or infinite arrival would never be released (generate waited for it for ever):
    every bad arrival_times (not finite, negative, not a number, one per prompt, decreasing)
    raises naming the argument, the index and the value, compiles nothing, and holds nothing
    (a guard fails the test, instead of hanging it, if generate does not return)."""
    free = free_blocks(any_engine)
    with compile_counter() as c, pytest.raises(ValueError) as e:
        generate_within(any_engine, 20, pd_prompts[:2], arrival_times=arrivals)
    assert says in str(e.value) and "arrival_times" in str(e.value) and c.count == 0
    assert_nothing_held(any_engine, free)


@pytest.mark.parametrize("kind", ["zero_row"])
def test_a_payload_with_a_wrong_row_count_and_its_own_checksum_fails_alone(engine, pd_prompts, pd_expected, kind):
    """Request 2's layer 1 arrives with one row more, all zeros: its checksum is the one sent,
    so only the decode side's row check can refuse it. Every attempt of request 2 does so:
    the request fails alone naming the rows outside its prompt (not a corrupt payload); the
    others finish exactly and nothing stays held."""
    free = free_blocks(engine)
    out, link = run_with_faults(engine, pd_prompts[:4], [Fault(kind, request=2, attempt=a) for a in (1, 2, 3)])
    assert [k for k, *_ in link.fired] == [kind] * 3
    n = len(pd_prompts[2])
    assert isinstance(out[2], RequestError), out[2]
    assert "malformed layer payload" in str(out[2]) and f"rows 0..{n} outside its {n}-token prompt" in str(out[2])
    assert out[:2] + out[3:] == pd_expected[:2] + pd_expected[3:4]
    assert engine.stats["malformed_payloads"] == 3 and engine.stats["corrupt_payloads"] == 0
    assert_nothing_held(engine, free)


def test_an_error_escaping_generate_leaves_the_pool_as_it_was(any_engine, pd_prompts, pd_expected):
    """A caller's on_token raises mid-run: generate raises it, and the requests it held
    (reserved blocks, running slots) are given back; the next run is clean."""
    free = free_blocks(any_engine)

    def on_token(i, t):
        if i == 0:
            raise RuntimeError("the caller's callback failed")
    with pytest.raises(RuntimeError, match="callback failed"):
        run_with_faults(any_engine, pd_prompts[:4], [], on_token=on_token)
    assert_nothing_held(any_engine, free)
    assert run_with_faults(any_engine, pd_prompts[:4], [])[0] == pd_expected[:4]


def test_cold_compiles_are_not_handoff_time(tiny_cfg, tiny_params, pd_prompts, pd_expected):
    """A fresh engine (every prompt bucket compiles on first use) with a 0.3 s handoff deadline
    on the real clock: the prefill reports each compile (Compiling), which does not count as
    'no progress', so a clean run records no handoff timeout and no retry."""
    eng = PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                   prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                   max_context=256, handoff_timeout_s=0.3, link_bandwidth_Bps=1e9)
    out = eng.generate(pd_prompts[:6], max_new_tokens=5)
    assert out == pd_expected[:6]
    assert eng.stats["handoff_timeouts"] == 0
    assert [r["prefill_attempts"] for r in eng.stats["requests"]] == [1] * 6
    kinds = collections.Counter(what for _, what, _ in eng.stats["trace"])
    assert kinds["CancelPrefill"] == 0
