"""AF disaggregation across processes: the FFN side in its own process (``pdjax serve --role
ffn``, 4 CPU devices), the attention side (AFDEngine with ``ffn_address``) in this one. The
tokens equal pdjax.generate for 2 and 3 attention ranks (4 and 12 exchange pieces), each way
moves exactly the hidden states (a formula from the config), params other than the FFN
process's are refused before any compute, and an FFN process that stalls or dies fails the
requests of its steps alone (RequestError naming the FFN side, within the deadline), leaves
nothing held, and a resumed one serves again."""

import os
import signal

import jax
import numpy as np
import pytest

import pdjax
from pdjax.disagg import AFDEngine, RequestError, launch_ffn

from faults import alive, assert_nothing_held, free_blocks
from child_env import CHILD_ENV

NEW = 5
LENS = (1, 7, 30, 13)


@pytest.fixture(scope="module")
def ffn():
    proc = launch_ffn("tiny", 0, devices=4, env=CHILD_ENV, startup_timeout=60)
    try:
        yield proc
    finally:
        proc.close()                                # SIGKILL, whatever happened
        assert not alive(proc.pid)


@pytest.fixture(scope="module")
def prompts(tiny_cfg):
    rng = np.random.RandomState(0)
    return [list(rng.randint(0, tiny_cfg.vocab_size, n)) for n in LENS]


@pytest.fixture(scope="module")
def expected(tiny_cfg, tiny_params, prompts):
    out = pdjax.generate(tiny_params, tiny_cfg, prompts, max_new_tokens=NEW)
    return out


def _engine(cfg, params, ffn, M, m, **kw):
    return AFDEngine(params, cfg, attention_devices=jax.devices()[:M], ffn_address=ffn.address, num_microbatches=m,
                     block_size=16, max_context=64, **kw)


@pytest.fixture(scope="module")
def eng(tiny_cfg, tiny_params, ffn):
    """2 attention ranks, 2 micro-batches: 2 * lcm(2, 4) = 8 slots."""
    return _engine(tiny_cfg, tiny_params, ffn, 2, 2)


def _moe_layers(cfg):
    return [l for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)]


def test_af_across_processes_equals_generate(tiny_cfg, eng, prompts, expected):
    """Every decode step moves every slot's hidden row of each MoE layer once each way
    (slots x D x 4 bytes; the routing and the seals counted apart)."""
    assert eng.decode.ffn.ranks == 4 and eng.decode.ffn.pieces == 4
    assert eng.generate(prompts, max_new_tokens=NEW) == expected
    afd = eng.stats["afd"]
    per_step = eng.decode.slots * tiny_cfg.hidden_size * 4
    assert afd["steps"] > 0 and afd["ffn_failures"] == 0 and afd["exchange_corrupt"] == 0
    for l in _moe_layers(tiny_cfg):
        assert afd["a2f_bytes"][l] == afd["f2a_bytes"][l] == afd["steps"] * per_step


def test_three_attention_ranks_against_four_ffn_ranks(tiny_cfg, tiny_params, ffn, prompts, expected):
    """3 : 4 ranks: a micro-batch crosses as lcm(3, 4) = 12 pieces each way."""
    e = _engine(tiny_cfg, tiny_params, ffn, 3, 1, prefill_mesh={"data": 3})
    try:
        assert e.decode.ffn.pieces == 12 and e.decode.slots == 12
        assert e.generate(prompts[:2], max_new_tokens=NEW) == expected[:2]
    finally:
        e.decode.ffn.close()


def test_two_attention_engines_share_one_ffn_process(tiny_cfg, tiny_params, ffn, eng, prompts, expected):
    """A second engine (2 other attention devices) on the same FFN process, both generating
    at once from two threads: the FFN process serves each connection's calls in order and
    both get the reference tokens (the deployment shape of AFD: several attention instances
    per FFN pool)."""
    import threading

    other = AFDEngine(tiny_params, tiny_cfg, attention_devices=jax.devices()[2:4], ffn_address=ffn.address,
                      num_microbatches=2, block_size=16, max_context=64)
    try:
        out = {}
        threads = [threading.Thread(target=lambda k, e: out.__setitem__(k, e.generate(prompts, max_new_tokens=NEW)),
                                    args=(k, e)) for k, e in enumerate((eng, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert out == {0: expected, 1: expected}
    finally:
        other.decode.ffn.close()


def test_params_other_than_the_ffn_process_are_refused(tiny_cfg, ffn):
    other = pdjax.init_params(tiny_cfg, jax.random.key(1))
    with pytest.raises(ValueError, match=r"other routed experts than these params \(layer 1 w_down"):
        _engine(tiny_cfg, other, ffn, 2, 2)
    with pytest.raises(ValueError, match="exactly one of ffn_devices"):
        AFDEngine(other, tiny_cfg, attention_devices=jax.devices()[:2], ffn_devices=jax.devices()[2:4],
                  ffn_address=ffn.address)


def test_a_stalled_ffn_process_fails_its_steps_alone_and_serves_when_resumed(eng, ffn, prompts, expected):
    """SIGSTOP: every answer misses its 3 s deadline, the step is run again once and its
    requests fail (RequestError naming the FFN side); nothing is held. SIGCONT: the late
    answers of the failed calls are dropped and the next batch is served exactly."""
    free = free_blocks(eng)
    remote = eng.decode.ffn
    remote.timeout_s = remote.receiver.timeout_s = 3.0     # as ffn_timeout_s=3 (the other tests keep
    os.kill(ffn.pid, signal.SIGSTOP)                       # 60 s: a cold FFN compile may take seconds)
    try:
        out = eng.generate(prompts[:2], max_new_tokens=NEW)
    finally:
        os.kill(ffn.pid, signal.SIGCONT)
        remote.timeout_s = remote.receiver.timeout_s = 60.0
    assert all(isinstance(o, RequestError) and "the FFN side failed" in str(o) and "TimeoutError" in str(o)
               for o in out), out
    assert_nothing_held(eng, free)
    assert eng.generate(prompts, max_new_tokens=NEW) == expected


def test_a_dead_ffn_process_fails_the_requests_not_the_engine(eng, ffn, prompts):
    """SIGKILL (last in the module): the connection ends, each request fails alone."""
    free = free_blocks(eng)
    ffn.kill()
    out = eng.generate(prompts[:2], max_new_tokens=NEW)
    assert all(isinstance(o, RequestError) and "the FFN side failed" in str(o) for o in out), out
    assert_nothing_held(eng, free)
