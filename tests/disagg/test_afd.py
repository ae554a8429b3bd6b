"""AF disaggregation on 8 CPU devices: AFDEngine's greedy tokens equal pdjax.generate for any
M:N split and m = 1..3 micro-batches, its logits the model's decode step's, step by step;
the exchange moves exactly the hidden states each way (routing counted apart) without a host
round trip; the micro-batches really ping-pong; a failing FFN call is retried or fails only
its micro-batch's requests; bad options fail before any compute."""

import math

import jax
import numpy as np
import pytest

import pdjax
from pdjax.disagg import AFDEngine, RequestError
from pdjax.disagg.request import Request
from pdjax.disagg.device_spans import DeviceSpans

from afd_faults import FailingFFN, FlippingExchange, SlowExchange
from faults import (BAD_ARRIVALS, Fault, assert_nothing_held, free_blocks, generate_within, run_with_faults,
                    run_with_hang)
from host_transfers import device_fetches

# a donation XLA cannot honour (no output to alias) warns: make it fail the tests
pytestmark = pytest.mark.filterwarnings("error:Some donated buffers were not usable")

NEW = 5
LENS = (1, 7, 60, 13, 60, 1, 13, 7)     # 1 to 60 tokens; few distinct lengths: fewer compiles


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    """The tiny model with 24 experts: they divide over 1, 2, 3, 4, 6 and 8 FFN ranks."""
    return tiny_cfg.replace(n_routed_experts=24)


@pytest.fixture(scope="module")
def params(cfg, tiny_params):
    """tiny_params with each MoE layer's router and routed experts widened to 24, drawn with
    numpy (no compile), scaled as pdjax.init_params scales them."""
    rng = np.random.RandomState(0)
    D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    layers = []
    for lp in tiny_params["layers"]:
        if "moe" in lp:
            shapes = {"router": ((D, E), D), "w_gate": ((E, D, F), D), "w_up": ((E, D, F), D), "w_down": ((E, F, D), F)}
            moe = {k: (rng.standard_normal(shape) * fan_in ** -0.5).astype(np.float32)
                   for k, (shape, fan_in) in shapes.items()}
            lp = {**lp, "moe": {**lp["moe"], **moe, "router_bias": np.zeros(E, np.float32)}}
        layers.append(lp)
    return jax.device_put({**tiny_params, "layers": layers})


@pytest.fixture(scope="module")
def prompts(cfg):
    rng = np.random.RandomState(0)
    return [list(rng.randint(0, cfg.vocab_size, n)) for n in LENS]


@pytest.fixture(scope="module")
def expected(cfg, params, prompts):
    out = pdjax.generate(params, cfg, prompts, max_new_tokens=NEW)
    return out


def _engine(cfg, params, M, N, m, block_size=32, **kw):
    return AFDEngine(params, cfg, attention_devices=jax.devices()[:M], ffn_devices=jax.devices()[M:M + N],
                     num_microbatches=m, block_size=block_size, max_context=128, **kw)


# Per M:N: the KV block size and prefill mesh (6:2 and 2:6 prefill replicated, one KV block a slot).
SPLITS = {(4, 4): {"block_size": 32}, (6, 2): {"block_size": 128, "prefill_mesh": {"data": 6}},
          (2, 6): {"block_size": 128, "prefill_mesh": {"data": 2}}}
MS = (1, 2, 3)


@pytest.fixture(scope="module")
def engines(cfg, params):
    """engines(M, N, m), made once per module. m * lcm(M, N) slots, so a micro-batch has
    lcm(M, N) rows whatever m, and as many KV blocks per rank as m = 3 needs: the engines of
    one M:N run the same compiled per-micro-batch programs (only m differs)."""
    made = {}

    def get(M, N, m):
        if (M, N, m) not in made:
            opts = SPLITS[(M, N)]
            base, blocks = math.lcm(M, N), -(-128 // opts["block_size"])
            made[M, N, m] = _engine(cfg, params, M, N, m, max_decode_slots=m * base,
                                    num_blocks=max(MS) * base // M * blocks + 1, **opts)
        return made[M, N, m]
    return get


@pytest.fixture(scope="module")
def eng(engines):
    """4 attention and 4 FFN devices, 2 micro-batches, 32-token KV blocks."""
    return engines(4, 4, 2)


@pytest.mark.parametrize("M, N", list(SPLITS))
@pytest.mark.parametrize("m", MS)
def test_afd_equals_generate(engines, prompts, expected, M, N, m):
    """All prompts (1 to 60 tokens) on 4:4 (prefill expert-parallel over the attention
    devices); the longest, the shortest and a 13-token one on 6:2 and 2:6 (prefill
    replicated there: each engine compiles per prompt length and view bucket)."""
    e = engines(M, N, m)
    some = range(len(prompts)) if (M, N) == (4, 4) else [2, 0, 3]
    assert e.generate([prompts[i] for i in some], max_new_tokens=NEW) == [expected[i] for i in some]
    afd = e.stats["afd"]
    assert afd["steps"] > 0 and afd["ffn_failures"] == 0 and afd["microbatches"] == m
    assert afd["exchange_corrupt"] == 0                      # a clean run: every seal matched


def test_each_side_holds_its_weights(cfg, eng):
    """The attention side uses the prefill's placed params (colocated: one copy on its
    devices); the FFN side holds only the routed experts, 24 / N per FFN device."""
    for a, b in zip(jax.tree.leaves(eng.prefill.params), jax.tree.leaves(eng.decode.params)):
        assert [s.data.unsafe_buffer_pointer() for s in a.addressable_shards] == \
            [s.data.unsafe_buffer_pointer() for s in b.addressable_shards]
    ffn = eng.decode.ffn
    for l, lp in enumerate(ffn.params):
        assert set(lp.get("moe", {})) == ({"w_gate", "w_up", "w_down"} if cfg.is_moe_layer(l) else set())
        for w in lp.get("moe", {}).values():
            assert {s.device for s in w.addressable_shards} == set(ffn.mesh.devices.flat)
            assert {s.data.shape[0] for s in w.addressable_shards} == {cfg.n_routed_experts // 4}


def test_exchange_moves_exactly_the_hidden_states(cfg, eng, prompts, expected):
    """One request: NEW - 1 decode steps (the first token is the prefill's), each moving every
    slot's row (empty slots' rows cross too: the step's shapes are static) of each MoE layer
    once each way; routing (ids, weights int32/float32 [k], the valid flag) apart; dense
    layers move nothing. Each piece's seal (2 uint32 per leaf: 4 leaves A2F, 1 F2A) counted apart."""
    assert eng.generate([prompts[2]], max_new_tokens=NEW) == [expected[2]]
    afd, D, k, item = eng.stats["afd"], cfg.hidden_size, cfg.num_experts_per_tok, np.dtype(cfg.compute_dtype).itemsize
    moe = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)]
    rows = afd["steps"] * eng.decode.slots
    assert afd["steps"] == NEW - 1
    assert afd["a2f_bytes"] == afd["f2a_bytes"] == {l: rows * D * item for l in moe}
    assert afd["routing_bytes"] == {l: rows * (2 * k * 4 + 1) for l in moe}
    pieces = afd["steps"] * len(moe) * eng.decode.m * eng.decode.exchange.pieces
    assert afd["check_bytes"] == pieces * (4 + 1) * 2 * 4


def _admit(pool, cfg, params, prompts):
    """Prefill ``prompts`` with the model and hand their KV to the pool; returns {slot: index},
    the model's cache after the prompts and the first tokens."""
    T = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), T), np.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    logits, cache = pdjax.prefill(params, cfg, tokens, lengths=lens, max_len=T + NEW)
    first = np.argmax(np.asarray(logits)[np.arange(len(prompts)), lens - 1], -1)
    slots = {}
    for i, p in enumerate(prompts):
        res = pool.reserve(Request(i, p, NEW))
        for layer, kv in enumerate(cache.kv):
            pool.receive_layer(res, layer, jax.device_put(kv[i, :len(p)], pool.target_device(res)))
        slots[pool.admit(res, int(first[i]))] = i
    return slots, cache, first.astype(np.int32)


def test_logits_equal_the_model_step_by_step_and_a_failed_ffn_call_is_retried(cfg, params, eng, prompts):
    """The pool filled (8 requests: both micro-batches on every rank). Each step's logits are
    the model's decode step's on the same prompts; an FFN call that raises once is retried
    and changes nothing; so does a bit flipped on the A2F in step 1 (caught by its checksum,
    the micro-batch run again and the step sampled again from the state before it)."""
    pool = eng.decode
    slots, cache, toks = _admit(pool, cfg, params, prompts)
    assert {pool.microbatch(s) for s in slots} == {0, 1}
    inner, pool.ffn = pool.ffn, FailingFFN(pool.ffn, fail_calls={1})     # layer 1, micro-batch 1, step 0
    # A2F calls of step 0: layer 1 mb 0, mb 1 (its FFN call fails), layer 2 mb 0, mb 1's rerun (2):
    # call 6 is step 1's layer 1 mb 1
    exchange = pool.exchange = FlippingExchange(pool.exchange, a2f={6})
    try:
        for _ in range(NEW - 1):
            want, cache = pdjax.decode_step(params, cfg, toks, cache)
            got = pool.step()
            for s, i in slots.items():
                np.testing.assert_allclose(np.asarray(pool.logits[s]), np.asarray(want[i]), rtol=0, atol=1e-4)
            toks = np.argmax(np.asarray(want), -1).astype(np.int32)
            assert {i: got[s] for s, i in slots.items()} == dict(enumerate(toks.tolist()))
    finally:
        pool.ffn, pool.exchange = inner, exchange.inner
        for s in slots:
            pool.release(s)
    assert pool.ffn is inner and pool.stats["ffn_retries_ok"] == 1
    assert exchange.flipped == [("a2f", 6)] and pool.stats["exchange_corrupt"] == 1


def test_ffn_failure_fails_only_its_microbatch(cfg, params, eng, prompts):
    """Micro-batch 1's FFN call fails and so does its rerun: its requests get a RequestError
    naming the FFN side, micro-batch 0's tokens stand, and the next step serves them
    correctly (nothing lost or duplicated)."""
    pool = eng.decode
    slots, cache, toks = _admit(pool, cfg, params, prompts)
    inner, pool.ffn = pool.ffn, FailingFFN(pool.ffn, fail_calls={1, 3})
    try:
        want, cache = pdjax.decode_step(params, cfg, toks, cache)
        got = pool.step()
        for s, i in slots.items():
            if pool.microbatch(s) == 1:
                assert isinstance(got[s], RequestError) and "FFN side failed" in str(got[s]), got[s]
                pool.release(s)                                   # as the scheduler does
            else:
                assert got[s] == int(np.argmax(np.asarray(want[i])))
        toks = np.argmax(np.asarray(want), -1).astype(np.int32)
        want, _ = pdjax.decode_step(params, cfg, toks, cache)
        got = pool.step()
        left = {s: i for s, i in slots.items() if pool.microbatch(s) == 0}
        assert got == {s: int(np.argmax(np.asarray(want[i]))) for s, i in left.items()}
    finally:
        pool.ffn = inner
        for s in pool.active:
            pool.release(s)


@pytest.mark.parametrize("direction, call, at", [("a2f", 0, (0, 0, 0, 0, 0)), ("f2a", 3, (0, 0, 0, 0, 0)),
                                                 ("a2f", 2, (0, 1, 3, -1, 1)), ("f2a", 1, (0, 0, 2, -1, 5))])
def test_a_flipped_bit_on_the_exchange_is_detected_and_the_step_rerun(eng, prompts, expected, direction, call, at):
    """A float32's top exponent bit flips on the wire in the hidden states (A2F) or in the
    experts' output (F2A), at the first element on the first rank, or (``at``: piece array,
    leaf, rank, row, column) in the routing weights' last row on FFN rank 3 or a middle
    element of the output on attention rank 2 (test_afd_seal.py: every row and leaf): the
    receiving program's checksum differs from the seal, the micro-batch's step runs again from
    its unchanged inputs: the tokens are pdjax.generate's, the stats count one detection and
    nothing stays held."""
    free, ex = free_blocks(eng), eng.decode.exchange
    eng.decode.exchange = flipping = FlippingExchange(ex, **{direction: {call}}, at=at)
    try:
        out = eng.generate(prompts[:4], max_new_tokens=NEW)
    finally:
        eng.decode.exchange = ex
    assert flipping.flipped == [(direction, call)]
    assert out == expected[:4]
    assert eng.stats["afd"]["exchange_corrupt"] == 1 and eng.stats["afd"]["ffn_failures"] == 0
    assert_nothing_held(eng, free)


def test_an_exchange_corrupt_on_every_attempt_fails_only_its_microbatch(cfg, params, eng, prompts):
    """Micro-batch 1's A2F arrives corrupt in step 0 and again in its rerun: its requests get a
    RequestError naming the corrupt exchange, micro-batch 0's tokens are the model's."""
    pool = eng.decode
    pool.begin()
    slots, cache, toks = _admit(pool, cfg, params, prompts)
    exchange = pool.exchange = FlippingExchange(pool.exchange, a2f={1, 4})   # mb 1 at layer 1, then its rerun
    try:
        want, _ = pdjax.decode_step(params, cfg, toks, cache)
        got = pool.step()
    finally:
        pool.exchange = exchange.inner
        for s in pool.active:
            pool.release(s)
    assert exchange.flipped == [("a2f", 1), ("a2f", 4)] and pool.stats["exchange_corrupt"] == 2
    for s, i in slots.items():
        if pool.microbatch(s) == 1:
            assert isinstance(got[s], RequestError) and "corrupt payload to micro-batch 1" in str(got[s]), got[s]
        else:
            assert got[s] == int(np.argmax(np.asarray(want[i])))


def test_engine_fails_the_requests_of_a_failed_step_and_serves_the_rest(eng, prompts, expected):
    """Every FFN call of the first decode step fails (and their reruns): the requests running
    then end with a RequestError, the others (arriving later) finish exactly; what was
    streamed is a prefix of the right tokens; the engine serves the next batch."""
    assert eng.generate(prompts[:4], max_new_tokens=NEW) == expected[:4]     # compiled: step 0 comes at once
    inner, eng.decode.ffn = eng.decode.ffn, FailingFFN(eng.decode.ffn, fail_calls={0, 1, 2, 3})
    streamed = {}
    try:
        out = eng.generate(prompts[:4], max_new_tokens=NEW, arrival_times=[0, 0.5, 0.5, 0.5],
                           on_token=lambda i, t: streamed.setdefault(i, []).append(t))
    finally:
        eng.decode.ffn = inner
    assert isinstance(out[0], RequestError) and "FFN side failed" in str(out[0])
    assert out[1:] == expected[1:4]
    assert all(streamed[i] == expected[i][:len(streamed[i])] for i in streamed)
    assert eng.generate(prompts[:2], max_new_tokens=NEW) == expected[:2]


def test_step_never_waits_on_the_host_but_for_the_tokens(cfg, params, engines, prompts):
    """Nothing is copied from the host in a step and the one device-to-host copy is the
    tokens (with the exchange's checksum verdicts): the exchange's copies (M != N too) never
    go through the host."""
    for e in (engines(4, 4, 2), engines(2, 6, 1)):
        pool = e.decode
        slots, _, _ = _admit(pool, cfg, params, prompts[:2])
        pool.step()                                               # compiled outside the guard
        with device_fetches() as fetches:
            for _ in range(2):
                pool.step()
        for s in slots:
            pool.release(s)
        assert fetches == [(pool.slots + pool.m,)] * 2             # the tokens and each micro-batch's verdict


def test_microbatches_ping_pong(cfg, eng, prompts, expected, tmp_path):
    """Over an exchange slower than the attention (each A2F copy holds ~0.1 s of device time),
    micro-batch 1's attention is issued, and done, while micro-batch 0's round trip through
    the FFN side is still in flight, at every MoE layer of every step (an engine that waits
    for micro-batch 0 before micro-batch 1 fails both)."""
    ex = eng.decode.exchange
    eng.decode.exchange = SlowExchange(ex)
    try:
        eng.timeline = DeviceSpans()
        assert eng.generate([prompts[1]], max_new_tokens=3) == [expected[1][:3]]
    finally:
        eng.decode.exchange, tl, eng.timeline = ex, eng.timeline, None
    afd = eng.stats["afd"]
    spans = {(s["stream"], s["name"]): s for s in afd["timeline"]}
    moe = [l for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)]
    pairs = [(spans["f2a", f"step {t} layer {l} mb 0"], spans["attention", f"step {t} layer {l} mb 1"])
             for t in range(afd["steps"]) for l in moe]
    assert len(pairs) == 2 * len(moe)
    assert all(att1["issued"] < trip0["ready"] for trip0, att1 in pairs), pairs
    assert all(att1["ready"] < trip0["ready"] for trip0, att1 in pairs), pairs
    assert set(afd["stage_s"]) == {"attention", "a2f", "ffn", "f2a"}
    assert afd["stage_s"]["a2f"]["mean"] > afd["stage_s"]["attention"]["mean"]
    trace = tl.to_chrome_trace(str(tmp_path / "afd_trace.json"))
    assert any(e.get("cat") == "ffn" for e in trace["traceEvents"])


@pytest.mark.parametrize("M, N, m, slots, match", [
    (3, 5, 2, None, "24 routed experts do not divide over the 5 FFN devices"),
    (4, 4, 5, None, "num_microbatches must be an integer in 1..4"),
    (4, 4, 0, None, "num_microbatches must be an integer in 1..4"),
    (4, 4, 3, 8, "needs at least 3 decode slots on each of the 4 attention ranks"),
    (2, 6, 2, 8, "use a multiple of 12"),
])
def test_bad_options_fail_before_compute(cfg, params, M, N, m, slots, match):
    with pytest.raises(ValueError, match=match):
        _engine(cfg, params, M, N, m, max_decode_slots=slots)


def test_overlapping_devices_fail(cfg, params):
    with pytest.raises(ValueError, match=r"must be disjoint; both hold device ids \[3\]"):
        AFDEngine(params, cfg, attention_devices=jax.devices()[:4], ffn_devices=jax.devices()[3:7])


def test_engine_survives_a_stalled_a_hung_and_a_malformed_send(eng, prompts, expected):
    """AFD's prefill shares the attention devices' pool lock (as a colocated engine's): a
    stalled send of request 2 is cancelled by its 1 s deadline while requests 0 and 1 decode,
    a send that never returns costs its request one attempt, and a float16 payload on every
    attempt fails request 2 alone; the others finish exactly and nothing stays held."""
    eng.handoff_timeout_s = 1.0
    long = [40, 40, NEW, NEW]
    try:
        free = free_blocks(eng)
        out, link = run_with_faults(eng, prompts[:4], [Fault("stall", request=2, seconds=10.0, max_wait_s=20.0)],
                                    long)
        assert [o[:NEW] for o in out] == expected[:4] and link.stall_ends == ["cancelled"]
        out, hanging = run_with_hang(eng, prompts[:4], Fault("hang", request=2, seconds=10.0), long)
        assert hanging == 1 and [o[:NEW] for o in out] == expected[:4]
        assert [r["prefill_attempts"] for r in eng.stats["requests"]] == [1, 1, 2, 1]
        out, _ = run_with_faults(eng, prompts[:4], [Fault("wrong_dtype", request=2, attempt=a) for a in (1, 2, 3)])
        assert isinstance(out[2], RequestError) and "payload dtype float16" in str(out[2])
        assert out[:2] + out[3:] == expected[:2] + expected[3:4]
        assert_nothing_held(eng, free)
    finally:
        eng.handoff_timeout_s = None


@pytest.mark.parametrize("arrivals,says", BAD_ARRIVALS)
def test_bad_arrival_times_fail_before_any_compute(eng, prompts, compile_counter, arrivals, says):
    """As a PD engine's (test_faults.py): a NaN, infinite, negative, non-numeric, decreasing
    or miscounted arrival_times raises naming it before any compute, instead of hanging."""
    free = free_blocks(eng)
    with compile_counter() as c, pytest.raises(ValueError) as e:
        generate_within(eng, 20, prompts[:2], max_new_tokens=NEW, arrival_times=arrivals)
    assert says in str(e.value) and c.count == 0
    assert_nothing_held(eng, free)


def test_bad_requests_fail_alone(cfg, eng, prompts, expected):
    """Empty, out-of-vocabulary, nested, float and over-long prompts and a bool count each get
    their RequestError; the good requests around them decode exactly as pdjax.generate."""
    batch = [prompts[1], [], [cfg.vocab_size], [[1, 2], [3, 4]], prompts[3], [2.9, 7], [1] * 300, prompts[0]]
    out = eng.generate(batch, max_new_tokens=[NEW] * 7 + [True])
    assert out[0] == expected[1] and out[4] == expected[3]
    for i, says in ((1, "empty prompt"), (2, "outside"), (3, "flat list"), (5, "float64"), (6, "exceeds the context"),
                    (7, "max_new_tokens must be a positive integer, got True")):
        assert isinstance(out[i], RequestError) and says in str(out[i]), (i, out[i])
