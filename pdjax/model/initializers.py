"""Random initialisation shared by the param makers of mla, moe and transformer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scaled_normal(key, shape, std, dtype):
    """Normal(0, std^2) samples of ``shape`` in ``dtype``, drawn in float32.

    The barrier keeps XLA from folding ``std`` into the sampler's own constants under jit, so
    an init traced into shardings (``init_params(..., mesh=)``) gives the same bits as the
    eager one."""
    return (jax.lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32)) * std).astype(dtype)
