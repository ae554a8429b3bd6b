"""The decode pool's check of an arrived layer payload (pdjax.disagg.decode.DecodePool.
check_payload), at each boundary: the engine fault tests send one malformed payload of each
kind (a row too many, the wrong device, float16), where a check one off at a boundary (the
first or the last layer, a start of 0, a chunk ending exactly at the prompt's end, the last
row a layer still lacks) is silent until a legal payload is refused or a bad one written."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.disagg.decode import DecodePool
from pdjax.disagg.request import Request

N = 5                   # prompt tokens


@pytest.fixture(scope="module")
def pool(tiny_cfg, tiny_params):
    return DecodePool(tiny_params, tiny_cfg, jax.devices()[:2], {"data": 2}, slots=4, block_size=4,
                      min_view_tokens=1, max_context=64)


@pytest.fixture
def res(pool):
    r = pool.reserve(Request(9, list(range(N)), 3))
    yield r
    pool.cancel(r)


def _rows(pool, res, T, dtype=jnp.float32, width=None, device=None):
    W = pool.cfg.kv_latent_dim if width is None else width
    return jax.device_put(jnp.ones((T, W), dtype), device or pool.target_device(res))


def _refused(pool, res, layer, rows, start, says):
    with pytest.raises(ValueError, match=re.escape(f"request 9 layer {layer!r}: ") + says):
        pool.check_payload(res, layer, rows, start)


def test_the_layer_index_and_the_payload_type(pool, res):
    """Layers 0 and L-1 accepted; -1, L and a float refused; a numpy array is not a payload."""
    L = pool.cfg.num_hidden_layers
    for layer in (0, L - 1, np.int32(1)):
        pool.check_payload(res, layer, _rows(pool, res, 1), 0)
    for layer in (-1, L, 1.0):
        _refused(pool, res, layer, _rows(pool, res, 1), 0, rf"no such layer \(the pool caches {L} layers\)")
    _refused(pool, res, 0, np.ones((1, pool.cfg.kv_latent_dim), np.float32), 0, "payload is a ndarray, not a jax.Array")


def test_the_payload_shape(pool, res):
    """[T >= 1, C+R]: one row and the whole prompt accepted; no rows, a wrong width, 1-D
    and 3-D payloads refused, naming the shape."""
    W = pool.cfg.kv_latent_dim
    pool.check_payload(res, 0, _rows(pool, res, 1), 0)
    pool.check_payload(res, 0, _rows(pool, res, N), 0)
    dev = pool.target_device(res)
    for rows in (_rows(pool, res, 0), _rows(pool, res, 2, width=W + 1), _rows(pool, res, 2, width=W - 1),
                 jax.device_put(jnp.ones(W), dev), jax.device_put(jnp.ones((2, W, 1)), dev)):
        _refused(pool, res, 0, rows, 0, re.escape(f"payload of shape {tuple(rows.shape)}, expected [T >= 1, {W}]"))


def test_the_rows_must_lie_inside_the_prompt(pool, res):
    """Rows start..start+T-1 inside the prompt: start 0 and a chunk ending at the prompt's last
    token accepted; a negative or float start, or one row past the end, refused, naming the
    rows."""
    pool.check_payload(res, 0, _rows(pool, res, 2), 0)
    pool.check_payload(res, 0, _rows(pool, res, 2), N - 2)
    pool.check_payload(res, 0, _rows(pool, res, 1), N - 1)
    _refused(pool, res, 0, _rows(pool, res, 2), N - 1, rf"rows {N - 1}\.\.{N} outside its {N}-token prompt")
    _refused(pool, res, 0, _rows(pool, res, 3), -1, rf"rows -1\.\.1 outside its {N}-token prompt")
    _refused(pool, res, 0, _rows(pool, res, 1), 1.0, rf"rows 1\.0\.\.1\.0 outside its {N}-token prompt")


def test_no_more_rows_than_the_layer_still_lacks(pool, res):
    """After ``have`` rows of a layer arrived, T more are accepted while have + T <= the
    prompt, per layer (another layer's count does not matter)."""
    L = pool.cfg.num_hidden_layers
    res.rows_received = [0] * L
    res.rows_received[1] = N - 2
    pool.check_payload(res, 1, _rows(pool, res, 2), 0)
    pool.check_payload(res, 0, _rows(pool, res, N), 0)
    _refused(pool, res, 1, _rows(pool, res, 3), 0, rf"3 more rows after {N - 2} of a {N}-token prompt")
    res.rows_received = []


def test_the_payload_dtype_and_device(pool, res):
    """The config's dtypes accepted, float16 and int32 refused; the reserving rank's device
    only: another rank's, or both, refused, naming the devices."""
    cfg = pool.cfg
    for name in {cfg.param_dtype, cfg.compute_dtype, cfg.kv_cache_dtype}:
        pool.check_payload(res, 0, _rows(pool, res, 1, dtype=jnp.dtype(name)), 0)
    for dtype in (jnp.float16, jnp.int32):
        _refused(pool, res, 0, _rows(pool, res, 1, dtype=dtype), 0, f"payload dtype {jnp.dtype(dtype).name}")
    other = pool.rank_devices[1 - res.rank]
    _refused(pool, res, 0, _rows(pool, res, 1, device=other), 0,
             re.escape(f"payload on {[other]}, expected on rank {res.rank}'s device {pool.target_device(res)}"))
    both = jax.device_put(jnp.ones((2, cfg.kv_latent_dim)), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(pool.rank_devices), ("d",)), jax.sharding.PartitionSpec("d")))
    devs = sorted(pool.rank_devices, key=lambda d: d.id)
    _refused(pool, res, 0, both, 0, re.escape(f"payload on {devs}, expected on rank {res.rank}"))
