"""PD engine scheduling: cost-model chunked prefill, several prefill workers balanced by
predicted cost, the colocated engine decoding between chunks, handoff timeouts, the
transfer-bandwidth signal. Tokens always equal pdjax.generate's."""

import math

import jax
import pytest
from faults import Fault, FaultyLink, ManualClock

from pdjax.analysis.costmodel_fit import PrefillCostFit
from pdjax.disagg import ColocatedEngine, PDEngine
from pdjax.disagg.chunking import largest_chunk
from pdjax.disagg.signals import Signals

ITEMSIZE = 4


def _latent_bytes(cfg, prompts):
    return sum(len(p) for p in prompts) * cfg.kv_latent_dim * cfg.num_hidden_layers * ITEMSIZE


def _cost(a=0.0, b=0.0, g=0.0, d=0.0):
    return PrefillCostFit(a=a, b=b, g=g, r2=1.0, n=0, d=d)


def test_largest_chunk_by_bisection_matches_the_closed_form():
    fit = _cost(a=2e-6, b=1e-5, g=1e-3, d=1e-3)
    plain = lambda q, c: fit(q, c)                                     # noqa: E731 - no max_chunk
    for c in (0, 17, 300):
        for budget in (0.0005, 0.01, 0.05, 0.4):
            assert largest_chunk(plain, c, budget, 512) == largest_chunk(fit, c, budget, 512)
    assert largest_chunk(fit, 0, 0.0005, 512) == 1                      # always progress


@pytest.fixture(scope="module")
def chunked(tiny_cfg, tiny_params):
    # cost(q, c) = g q + b q c: the largest chunk within the budget is floor(B / (g + b c)),
    # rounded down to whole padding buckets of the EP4 prefill pool (powers of two >= 16)
    return PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                    prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                    max_context=256, prefill_cost=_cost(b=1e-5, g=1e-3), prefill_budget_s=0.1323,
                    prefix_cache={"host_blocks": 64})


def _expected_chunks(T, start, g=1e-3, b=1e-5, budget=0.1323):
    out, c = [], start
    while c < T:
        q = 2 ** math.floor(math.log2(max(math.floor(budget / (g + b * c)), 16)))
        q = min(q, T - c)
        out.append(q)
        c += q
    return out


def test_cost_model_chunked_prefill(tiny_cfg, chunked, pd_prompts, pd_expected):
    assert chunked.generate(pd_prompts, max_new_tokens=5) == pd_expected
    reqs = chunked.stats["requests"]
    for p, r in zip(pd_prompts, reqs):
        assert r["prefill_chunks"] == _expected_chunks(len(p), r["prefix_hit_tokens"])
    assert reqs[2]["prefill_chunks"] == [128, 32, 32, 8]                 # 200 tokens: the chunks shrink
    assert chunked.stats["kv_bytes_sent"] == _latent_bytes(tiny_cfg, pd_prompts)
    # again: cached prefixes, the rest chunked from there; tokens and bytes unchanged
    assert chunked.generate(pd_prompts, max_new_tokens=5) == pd_expected
    reqs = chunked.stats["requests"]
    assert [r["prefix_hit_tokens"] for r in reqs] == [((len(p) - 1) // 16) * 16 for p in pd_prompts]
    for p, r in zip(pd_prompts, reqs):
        assert r["prefill_chunks"] == _expected_chunks(len(p), r["prefix_hit_tokens"])
    assert chunked.stats["kv_bytes_sent"] == _latent_bytes(tiny_cfg, pd_prompts)


def test_retry_does_not_wait_for_later_arrivals(chunked, pd_prompts, pd_expected):
    """Request 0's handoff fails once; its retry is released at once, not behind request 1,
    which arrives 2.5 s later (its TTFT stays far below that)."""
    link = chunked.link
    chunked.link = FaultyLink(link, [Fault("fail", layer=1, request=0)])
    try:
        out = chunked.generate(pd_prompts[:2], max_new_tokens=5, arrival_times=[0.0, 2.5])
    finally:
        chunked.link = link
    assert out == pd_expected[:2]
    r0 = chunked.stats["requests"][0]
    assert r0["prefill_attempts"] == 2 and r0["ttft"] < 1.5, r0["ttft"]


def test_prefill_workers_balance_by_predicted_cost(tiny_cfg, tiny_params, pd_prompts, pd_expected):
    """cost = 1 s per token (predicted only): all requests arrive at once and each goes to the
    worker predicted to finish it first. Prompt lengths 1, 7, 33, 2, 45, 61 -> predicted free
    times (w0, w1): (1, 0) (1, 7) (34, 7) (34, 9) (34, 54) (95, 54)."""
    pick = (0, 1, 3, 4, 6, 7)
    prompts, expected = [pd_prompts[i] for i in pick], [pd_expected[i] for i in pick]
    eng = PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                   prefill_workers=2, prefill_mesh={"expert": 2}, decode_mesh={"data": 2, "expert": 2},
                   max_decode_slots=4, max_context=256, prefill_cost=_cost(g=1.0), prefix_cache=True)
    assert [len(p) for p in prompts] == [1, 7, 33, 2, 45, 61]
    assert eng.generate(prompts, max_new_tokens=5) == expected
    reqs = eng.stats["requests"]
    assert [r["prefill_worker"] for r in reqs] == [0, 1, 0, 1, 1, 0]
    assert [r["predicted_prefill_s"] for r in reqs] == [float(len(p)) for p in prompts]
    assert eng.stats["kv_bytes_sent"] == _latent_bytes(tiny_cfg, prompts)
    # one prefix cache shared by both workers: every prompt hits, whichever worker runs it
    assert eng.generate(prompts, max_new_tokens=5) == expected
    reqs = eng.stats["requests"]
    assert [r["prefix_hit_tokens"] for r in reqs] == [((len(p) - 1) // 16) * 16 for p in prompts]
    assert {r["prefill_worker"] for r in reqs} == {0, 1}


def _interleaving(engine, prompts, max_new_tokens):
    """Program order of the long prompt's layer pushes and the short request's tokens."""
    events = []
    link = engine.link
    engine.link = FaultyLink(link, on_send=lambda chunk: events.append(("push", chunk.request)))
    try:
        out = engine.generate(prompts, max_new_tokens=max_new_tokens,
                              on_token=lambda i, t: events.append(("token", i)))
    finally:
        engine.link = link
    pushes = [k for k, e in enumerate(events) if e == ("push", 1)]
    between = [e for e in events[pushes[0]:pushes[-1]] if e == ("token", 0)]
    return out, len(between)


def test_colocated_decodes_between_prefill_chunks(tiny_cfg, tiny_params, pd_prompts, pd_expected):
    """A 200-token prompt lands while a request decodes. Unchunked, the colocated pool runs
    it as one step (at most the token of a step already under way slips in); in 16-token
    chunks, decode steps run between the chunks."""
    short, long = pd_prompts[1], pd_prompts[2]
    kw = dict(devices=jax.devices()[:4], mesh={"expert": 4}, max_decode_slots=4, max_context=256)
    whole = ColocatedEngine(tiny_params, tiny_cfg, **kw)
    chunks = ColocatedEngine(tiny_params, tiny_cfg, prefill_chunk_tokens=16, **kw)
    out_w, n_w = _interleaving(whole, [short, long], [40, 2])
    _interleaving(chunks, [short, long], [40, 2])      # compile first: the decode loop that
    out_c, n_c = _interleaving(chunks, [short, long], [40, 2])   # compiles cannot queue for the lock
    assert out_c == out_w
    # without a prefix cache the colocated engine gives pdjax.generate's tokens too
    assert out_w[0][:5] == pd_expected[1] and out_w[1] == pd_expected[2][:2]
    assert chunks.stats["requests"][1]["prefill_chunks"] == [16] * 12 + [8]
    assert n_w <= 1 and n_c >= 2, (n_w, n_c)


def test_handoff_timeout_reprefills(tiny_cfg, tiny_params, pd_prompts, pd_expected):
    """The link hangs on request 1's layer 1 while the (manual) clock moves 10 s: past its 1 s
    deadline the attempt is cancelled (which ends the hung transfer) and prefilled again.
    No wall-clock sleep: the test is deterministic."""
    eng = PDEngine(tiny_params, tiny_cfg, prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:],
                   prefill_mesh={"expert": 4}, decode_mesh={"data": 2, "expert": 2}, max_decode_slots=4,
                   max_context=256)
    eng.handoff_timeout_s = 1.0
    clock = ManualClock()
    link = eng.link
    eng.link = FaultyLink(link, [Fault("stall", layer=1, request=1, seconds=10.0)], clock=clock)
    try:
        out = eng.generate(pd_prompts[:4], max_new_tokens=5, clock=clock)
    finally:
        eng.link = link
    assert out == pd_expected[:4]
    assert eng.link is link and clock.now() == 10.0
    reqs = eng.stats["requests"]
    assert [r["handoff_timeouts"] for r in reqs] == [0, 1, 0, 0]
    assert [r["prefill_attempts"] for r in reqs] == [1, 2, 1, 1]
    assert eng.stats["handoff_timeouts"] == 1
    # only the completed attempt's bytes count
    assert eng.stats["kv_bytes_sent"] == _latent_bytes(tiny_cfg, pd_prompts[:4])


def test_transfer_signal_and_calibration(tiny_cfg, chunked, pd_prompts, pd_expected, monkeypatch):
    # its own run (the stats must not depend on which tests of this file ran before), sampling
    # the signals at every turn of the decode loop (a warm run can end within one interval)
    monkeypatch.setattr(Signals, "interval", 0.0)
    assert chunked.generate(pd_prompts[:2], max_new_tokens=5) == pd_expected[:2]
    s = chunked.stats
    assert s["link_bandwidth_Bps"] > 0
    assert s["link_utilisation"] == pytest.approx(s["kv_bytes_sent"] / s["elapsed_s"] / s["link_bandwidth_Bps"])
    assert s["signals"] and set(s["signals"][0]) == {"t", "prefill_queue_depth", "decode_kv_wait_p95_s",
                                                    "link_utilisation"}
    fit = chunked.calibrate_prefill(shapes=[(16, 0), (32, 0), (16, 32), (32, 32)], repeats=1, intercept=False)
    assert fit is chunked.prefill_cost and fit.n == 4
    assert all(t > 0 for *_, t in chunked.calibration_samples)
    assert chunked.calibration.fit is fit and set(chunked.calibration.repeats) == {(16, 0), (32, 0), (16, 32), (32, 32)}
    assert min(fit.a, fit.b, fit.g) >= 0 and fit(32, 32) > 0
    assert chunked.predicted_prefill_s(64) > 0


def test_scheduling_config_errors(tiny_cfg, tiny_params):
    kw = dict(prefill_devices=jax.devices()[:4], decode_devices=jax.devices()[4:])
    with pytest.raises(ValueError, match="prefill_workers=3"):
        PDEngine(tiny_params, tiny_cfg, prefill_workers=3, **kw)
    with pytest.raises(ValueError, match="prefill_budget_s must be > 0"):
        PDEngine(tiny_params, tiny_cfg, prefill_budget_s=0.0, **kw)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        PDEngine(tiny_params, tiny_cfg, prefill_chunk_tokens=0, **kw)
    with pytest.raises(ValueError, match="prefill_cost must be a callable"):
        PDEngine(tiny_params, tiny_cfg, prefill_cost=3.0, **kw)
    with pytest.raises(ValueError, match="prefill_workers must be 1"):
        ColocatedEngine(tiny_params, tiny_cfg, devices=jax.devices()[:4], prefill_workers=2)
