"""No host sync per decode step: with device inputs, decode_step and prefill check shapes and
dtypes only and read a cache's bounds from the lengths the host recorded, so a loop feeding
back the argmax never waits for the device and dispatches ahead of it
(benchmarks/decode_dispatch.py measures how far).

The test holds the device back: the first tokens come out of a host callback that waits on
an event the test sets only after the loop has returned. Any read of a device value in the
loop (np.asarray, int(), .tolist(), block_until_ready) would wait for that callback, and
the loop would not return while the gate is closed. (jax's device-to-host transfer guard
does not fire on XLA:CPU, and np.asarray reads a CPU array through the buffer protocol,
unseen by ArrayImpl._value, so a fetch counter would miss it.)"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pdjax
from pdjax.model.cache import KVCache, host_lengths

GATE_S = 20      # how long the loop gets to return while the device is held (it needs ~0.1 s)


def _held_back(tokens, gate):
    """``tokens`` again, on device 0, from a device computation that finishes only once
    ``gate`` is set. It runs on two devices: XLA:CPU runs a one-device program whose inputs
    are ready inline, in the calling thread (which would wait here), a two-device one on the
    devices' own threads."""
    def wait(x):
        gate.wait(2 * GATE_S)
        return x
    both = NamedSharding(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2]), P())
    held = jax.jit(lambda t: jax.pure_callback(wait, jax.ShapeDtypeStruct(t.shape, t.dtype), t),
                   out_shardings=both)(jax.device_put(tokens, both))
    return held.addressable_shards[0].data


def test_decode_loop_on_device_tokens_never_waits_for_the_device(tiny_cfg, tiny_params):
    cfg, params = tiny_cfg, tiny_params
    # the shapes of test_model's prefill-then-decode test: the same compiled programs
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, (3, 5))
    logits, cache = pdjax.prefill(params, cfg, prompt, max_len=14, lengths=[5, 4, 3])
    two = jnp.ones(2, jnp.int32)
    gate, returned, state = threading.Event(), threading.Event(), {}

    def loop(tok, cache):
        for _ in range(3):
            step, cache = pdjax.decode_step(params, cfg, tok, cache)
            tok = jnp.argmax(step, -1)                         # int32 on device, fed back
        state.update(tok=tok, cache=cache)
        with pytest.raises(TypeError, match="integer token ids"):
            pdjax.decode_step(params, cfg, step.max(-1), cache)    # float values as tokens
        with pytest.raises(ValueError, match="1 dims"):
            pdjax.decode_step(params, cfg, tok[:, None], cache)
        with pytest.raises(ValueError, match=r"lengths must be \[B=3\] integers"):
            pdjax.prefill(params, cfg, tok[:, None], cache=cache, lengths=two)
        returned.set()

    # first, every program the loop runs is compiled (with an open gate, on a second cache):
    # the gated run below must only dispatch, however slow compiling is on a loaded machine
    opened = threading.Event()
    opened.set()
    _, spare = pdjax.prefill(params, cfg, prompt, max_len=14, lengths=[5, 4, 3])
    loop(_held_back(jnp.argmax(logits[:, -1], -1), opened), spare)
    jax.block_until_ready(state["cache"])
    returned.clear()
    state.clear()
    first = _held_back(jnp.argmax(logits[:, -1], -1).block_until_ready(), gate)
    worker = threading.Thread(target=loop, args=(first, cache))
    worker.start()
    ahead = returned.wait(GATE_S)
    pending = "tok" in state and not state["tok"].is_ready()
    gate.set()
    worker.join()
    assert ahead and pending, "the decode loop waited for the device"
    tok, cache = state["tok"], state["cache"]
    _, cache = pdjax.prefill(params, cfg, jnp.tile(tok[:, None], (1, 6)), cache=cache)   # a 6-token chunk
    # the host's copy of the lengths is the device's: 5+3+6, 4+3+6, 3+3+6; row 0 is at max_len
    assert host_lengths(cache.lengths).tolist() == np.asarray(cache.lengths).tolist() == [14, 13, 12]
    with pytest.raises(ValueError, match="cache is full"):
        pdjax.decode_step(params, cfg, tok, cache)
    with pytest.raises(ValueError, match="exceeds max_len"):
        pdjax.prefill(params, cfg, tok[:, None], cache=cache)


def test_lengths_the_host_did_not_record_are_not_fetched(tiny_cfg):
    cache = pdjax.init_cache(tiny_cfg, 2, 4)
    assert host_lengths(cache.lengths).tolist() == [0, 0]
    made_elsewhere = KVCache(kv=cache.kv, lengths=jnp.full((2,), 4, jnp.int32))
    assert host_lengths(made_elsewhere.lengths) is None
    assert host_lengths(np.array([4, 4])).tolist() == [4, 4]
