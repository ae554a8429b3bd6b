"""Decode memory traffic: XLA's cost analysis of one compiled decode step (cache donated)
against the ideal, every param and the latent cache read once (benchmarks/mla_decode_traffic.py
sweeps the shapes; this checks two of them, compiling only: no arrays are allocated)."""

import jax
import jax.numpy as jnp
import pytest

import pdjax
from pdjax.model import transformer

TARGET = 3.0


def _bytes_over_ideal(cfg, batch, length):
    params = jax.eval_shape(lambda: pdjax.init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: pdjax.init_cache(cfg, batch, length))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)
    cost = transformer._decode_step.lower(params, cfg, tokens, cache).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ideal = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((params, cache.kv)))
    return cost["bytes accessed"] / ideal


@pytest.mark.parametrize("heads, rank, rope, length, batch", [
    (16, 32, 16, 1024, 8),      # the shape of issue 14 (4.95x there; the cache dominates the ideal)
    (4, 128, 32, 512, 4),
])
def test_decode_bytes_within_3x_of_params_plus_cache(heads, rank, rope, length, batch):
    """One dense layer, so the traffic is the attention's (the MoE's is not checked here)."""
    cfg = pdjax.configs.tiny(num_attention_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                             num_hidden_layers=1, max_position_embeddings=length)
    assert _bytes_over_ideal(cfg, batch, length) <= TARGET
