"""Activation-times-weight products in the compute dtype, shared by mla, moe and transformer."""

from __future__ import annotations

import jax.numpy as jnp


def einsum(spec: str, x, w):
    """``einsum(spec, x, w)`` in x.dtype, the weight ``w`` cast to it.

    Accumulated in float32 and rounded to x.dtype once, as an x.dtype-output dot is, but asked
    for as a float32-output dot and cast after: XLA:CPU runs a bf16-output dot on float32
    copies of both operands (a float32 copy of the weight each call, 3x the weight's bytes),
    a bf16-in, float32-out dot reads the bf16 weight as it is. A no-op change in float32."""
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def matmul(x, w):
    """``x @ w`` (x [..., D], w [D, F]) as :func:`einsum` computes it."""
    return einsum("...D,DF->...F", x, w)
