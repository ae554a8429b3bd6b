"""Faults injected at the KV link of an in-process PDEngine (tests/disagg/faults.py wraps
the engine's link; the clock is driven by hand, so nothing depends on wall-clock sleeps): a
failed transfer, a transfer stalled past its deadline, a corrupt layer payload, a prefill
worker that dies mid-transfer and a delayed transfer, each on its own request of one run.
Every request ends once with the tokens of pdjax.generate, each token streamed once, the
other requests untouched, and no KV block leaked."""

import collections

import jax
import pytest
from faults import Fault, FaultyLink, ManualClock

from pdjax.disagg import PDEngine

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
