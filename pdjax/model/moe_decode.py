"""The MoE's few-token (decode) paths, and the expert math they share with :mod:`pdjax.model.moe`.

Up to ``moe.FEW_TOKENS`` tokens the bucketed back end skips the sort and runs one of two exact
paths, chosen at run time by their cost (:func:`few_tokens`, a ``lax.cond``: one runs):
  * :func:`every_expert`: every token through every expert, one batched GEMM per weight matrix
    against all E experts' weights as stored: reads all E experts, a fixed cost of a few ops;
  * :func:`experts_in_use`: a loop over the experts some token chose, each read once; each step
    also copies its expert's matrices out of the stacked weights and pays the loop's dispatch
    (together about ``LOOP_STEP_BYTES`` of reading on XLA:CPU).
A token's output only ever adds the experts it chose, whatever the others compute (inf, NaN).

Precision: the expert matmuls take the tokens' dtype (the compute dtype; weights are cast to
it) and accumulate in float32, rounded back to that dtype (:func:`pdjax.model.dots.einsum`:
XLA:CPU would otherwise run a bfloat16 dot by converting both operands, the weights too, to
float32 first, a float32 copy of every weight it reads, each call); the rounding is the same. The weighted
sum of the experts' outputs is float32 (:func:`combine`, under ``COMBINE_SCOPE``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdjax.model import dots

COMBINE_SCOPE = "expert_combine"     # jax.named_scope of the float32 weighted sum of expert outputs

# One step of the experts-in-use loop costs about as much as reading this many more bytes of
# weights (XLA:CPU, measured ~0.1 ms a step against ~14 GB/s: the while/cond dispatch and the
# copy of the expert's three matrices out of the stacked weights).
LOOP_STEP_BYTES = 1 << 20


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU MLP [..., D] in x.dtype (the weights are cast to it; :func:`pdjax.model.dots.einsum`)."""
    h = jax.nn.silu(dots.einsum("...D,DF->...F", x, w_gate)) * dots.einsum("...D,DF->...F", x, w_up)
    return dots.einsum("...F,FD->...D", h, w_down)


def swiglu_grouped(x_GTD, w_gate, w_up, w_down):
    """[G,T,D] rows through G experts' weights [G,D,F], [G,D,F], [G,F,D]."""
    h_GTF = jax.nn.silu(dots.einsum("GTD,GDF->GTF", x_GTD, w_gate)) * dots.einsum("GTD,GDF->GTF", x_GTD, w_up)
    return dots.einsum("GTF,GFD->GTD", h_GTF, w_down)


def combine(y_NkD, weights_Nk, dtype):
    """sum_j weights[n,j] * y[n,j] in float32 (one fused gather-multiply-sum), cast to dtype."""
    with jax.named_scope(COMBINE_SCOPE):
        return (y_NkD.astype(jnp.float32) * weights_Nk[:, :, None]).sum(1).astype(dtype)


def _routing_EN(weights_Nk, idx_Nk, E):
    """(routed [E,N] bool: token n chose expert e, coef [E,N] float32: its routing weight)."""
    tokens = jnp.arange(idx_Nk.shape[0])[:, None]
    routed = jnp.zeros((E, idx_Nk.shape[0]), bool).at[idx_Nk, tokens].set(True)
    return routed, jnp.zeros(routed.shape, jnp.float32).at[idx_Nk, tokens].set(weights_Nk)


def experts_in_use(x_ND, weights_Nk, idx_Nk, w_gate, w_up, w_down):
    """A loop over the experts in use: each step reads one expert's weights (a dynamic index)
    and runs every token through it; a token adds weights[n,j] * y where idx[n,j] is that
    expert, nothing otherwise. For a few tokens (decode), where reading the weights, not the
    FLOPs, sets the time, this reads only the experts some token chose, each once.
    ``lax.scan`` over min(E, N*k) steps, those past the experts in use skipped by ``lax.cond``
    (so it differentiates). Summed in float32, in expert order. [N, D]."""
    N, D = x_ND.shape
    E = w_gate.shape[0]
    routed_EN, coef_EN = _routing_EN(weights_Nk, idx_Nk, E)
    in_use = routed_EN.any(1)
    steps = min(E, idx_Nk.size)
    experts = jnp.nonzero(in_use, size=steps, fill_value=0)[0].astype(jnp.int32)

    def through(e):
        w = (jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in (w_gate, w_up, w_down))
        y_ND = swiglu(x_ND, *w)
        with jax.named_scope(COMBINE_SCOPE):           # only tokens routed here add
            return jnp.where(routed_EN[e][:, None], y_ND.astype(jnp.float32) * coef_EN[e][:, None], 0.0)

    def step(acc_ND, i):
        add = jax.lax.cond(i < in_use.sum(), through, lambda e: jnp.zeros((N, D), jnp.float32), experts[i])
        with jax.named_scope(COMBINE_SCOPE):
            return acc_ND + add, None

    acc, _ = jax.lax.scan(step, jnp.zeros((N, D), jnp.float32), jnp.arange(steps))
    return acc.astype(x_ND.dtype)


def every_expert(x_ND, idx_Nk, w_gate, w_up, w_down):
    """Every token through every expert as one [E, N, D] batched GEMM against the weights as
    stored, then each assignment's row picked: [N, k, D]."""
    N, D = x_ND.shape
    E = w_gate.shape[0]
    y_END = swiglu_grouped(jnp.broadcast_to(x_ND, (E, N, D)), w_gate, w_up, w_down)
    return y_END.reshape(E * N, D)[idx_Nk * N + jnp.arange(N, dtype=jnp.int32)[:, None]]


def loop_is_cheaper(num_in_use, num_experts: int, expert_bytes: int, dtype):
    """Whether :func:`experts_in_use` costs less than :func:`every_expert` (a traced bool when
    ``num_in_use`` is traced): reading the experts in use plus ``LOOP_STEP_BYTES`` a step, against
    reading all E. In bfloat16 always: XLA:CPU's batched bf16 GEMM runs the few rows of every
    expert slower than the loop's (measured 3.2 vs 1.5 ms at E=16, D=512, F=256, 8 tokens)."""
    if jnp.dtype(dtype) != jnp.float32:
        return True
    return num_in_use * (expert_bytes + LOOP_STEP_BYTES) < num_experts * expert_bytes


def few_tokens(x_ND, weights_Nk, idx_Nk, w_gate, w_up, w_down):
    """The routed experts' weighted sum [N, D] for a few tokens: the experts-in-use loop or every
    expert, whichever :func:`loop_is_cheaper` says for the experts this routing uses (a
    ``lax.cond`` when both can win: only one runs)."""
    E, D, F = w_gate.shape
    expert_bytes = 3 * D * F * jnp.dtype(x_ND.dtype).itemsize
    loop = lambda: experts_in_use(x_ND, weights_Nk, idx_Nk, w_gate, w_up, w_down)       # noqa: E731
    every = lambda: combine(every_expert(x_ND, idx_Nk, w_gate, w_up, w_down), weights_Nk, x_ND.dtype)  # noqa: E731
    most = min(E, idx_Nk.size)            # the experts a routing can use at most
    if loop_is_cheaper(most, E, expert_bytes, x_ND.dtype) is True:
        return loop()
    if not loop_is_cheaper(1, E, expert_bytes, x_ND.dtype):
        return every()
    in_use = jnp.zeros((E,), bool).at[idx_Nk].set(True).sum()
    return jax.lax.cond(loop_is_cheaper(in_use, E, expert_bytes, x_ND.dtype), loop, every)
