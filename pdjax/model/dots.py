"""Activation-times-weight products in the compute dtype, shared by mla, moe and transformer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def einsum(spec: str, x, w):
    """``einsum(spec, x, w)`` in x.dtype, the weight ``w`` cast to it.

    Accumulated in float32 and rounded to x.dtype once, as an x.dtype-output dot is, but asked
    for as a float32-output dot and cast after: XLA:CPU runs a bf16-output dot on float32
    copies of both operands (a float32 copy of the weight each call, 3x the weight's bytes),
    a bf16-in, float32-out dot reads the bf16 weight as it is. A no-op change in float32."""
    return einsum_f32(spec, x, w.astype(x.dtype)).astype(x.dtype)


def matmul(x, w):
    """``x @ w`` (x [..., D], w [D, F]) as :func:`einsum` computes it."""
    return einsum("...D,DF->...F", x, w)


def einsum_f32(spec: str, x, w):
    """``einsum(spec, x, w)`` accumulated and returned in float32 (x and w as they are).

    A narrow-float (bf16, fp8) product whose activation has a single row (batch-1 decode) is
    run on two rows, the second zero, and the first kept: XLA:CPU rewrites a one-row dot as a
    multiply and a sum over a float32 copy of the whole weight (5x the weight's bytes, each
    call; bf16 [1, 2048] x [2048, 8192]: 47 ms, on two rows 5.9 ms). Products batched over an
    axis of the weight (per-head, per-expert) are left as they are."""
    axes = _single_row_axes(spec, x, w)
    if axes is None:
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    x_axis, out_axis = axes
    x2 = jnp.concatenate([x, jnp.zeros_like(x)], axis=x_axis)
    y = jnp.einsum(spec, x2, w, preferred_element_type=jnp.float32)
    return jax.lax.slice_in_dim(y, 0, 1, axis=out_axis)


def _single_row_axes(spec: str, x, w):
    """(axis of x, axis of the output) to pad for a one-row narrow-float product on XLA:CPU,
    else None: x's free axes (kept in the output, not in w) all of size 1, no axis shared by
    x, w and the output (a batched product), at least one free axis."""
    if jnp.dtype(x.dtype).itemsize >= 4 or jax.default_backend() != "cpu":
        return None
    ins, out = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    if "..." in xs:      # the ellipsis as lower-case letters (specs here are upper-case)
        ell = "".join(chr(ord("a") + i) for i in range(x.ndim - len(xs) + 3))
        xs, out = xs.replace("...", ell), out.replace("...", ell)
    if "..." in ws or set(xs) & set(ws) & set(out):
        return None
    free = [i for i, c in enumerate(xs) if c in out and c not in ws]
    if not free or math.prod(x.shape[i] for i in free) != 1:
        return None
    return free[0], out.index(xs[free[0]])


def logits_of(params, g):
    """The LM head on normed states (the main model's, or an MTP depth's): float32 logits."""
    return einsum_f32("...D,DV->...V", g, params["lm_head"].astype(g.dtype))
