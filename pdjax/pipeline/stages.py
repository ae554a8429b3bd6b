"""The model cut into pipeline stages, and each stage's F / B / I / W programs.

A pipeline of ``L`` stages holds the model in ``L`` *chunks* of consecutive decoder
layers (:mod:`pdjax.schedules.layer_split`): chunk 0 also embeds the tokens, chunk ``L-1``
also applies the final norm, the LM head and the next-token loss. Every stage runs one
chunk (its position in its pipeline), so DualPipe's two directions hold two copies of
every chunk.

Per stage and micro-batch the programs are (``sp`` the chunk's params, ``x`` the stage
input: token ids [b,T] on chunk 0, hidden states [b,T,D] elsewhere; ``tok`` the
micro-batch's token ids, needed by the loss):

- ``F(sp, x, tok) -> (y, res)``: the forward and the residuals of its VJP (``jax.vjp``'s
  backward closure flattened to arrays). ``y`` is the stage output (the micro-batch's loss
  share on the last chunk). Residuals that are params or the input itself are not copied
  out: the backward reads them from ``sp`` and ``x``.
- ``B(acc, sp, x, res, gy) -> (acc + grads, gx)``: the full backward; ``acc`` (the stage's
  gradient accumulator) is donated.
- ``I(sp, x, res, gy) -> (gx, carry)`` and ``W(acc, sp, kept, carry) -> acc + grads``
  (``kept``: the values of ``[x, *res, gy]`` W reads, see :attr:`StageProgram.w_keep`):
  the backward cut in two by partitioning its jaxpr: ``I`` is every equation the input
  gradient depends on, ``W`` every other equation the weight gradients need; ``carry`` is
  what ``W`` reads of ``I``'s values (per-layer output cotangents). Neither recomputes the
  forward, and together they are the backward's equations exactly once.

On chunk 0 the "input gradient" is the cotangent at the embedding output (nothing is sent
further back); the embedding's gradient (a scatter-add of it) is part of ``W``.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from jax._src import core as jcore

from pdjax.model_config import ModelConfig
from pdjax.model import transformer as tfm
from pdjax.model.loss import mtp_loss_mean, next_token_loss_sum
from pdjax.schedules.layer_split import Chunk


def chunk_params(params: dict, chunk: Chunk, with_mtp: bool = False) -> dict:
    """The params a chunk uses (a sub-pytree of the model's). ``with_mtp``: the last chunk also
    holds the MTP modules and the embedding they share (its gradient from there is summed
    with chunk 0's: one rank holds both in DualPipe and DualPipeV, as DeepSeek-V3 places them)."""
    sp = {"layers": list(params["layers"][chunk.start:chunk.stop])}
    if chunk.first or (chunk.last and with_mtp):
        sp["embed"] = params["embed"]
    if chunk.last:
        sp["final_norm"] = params["final_norm"]
        sp["lm_head"] = params["lm_head"]
        if with_mtp:
            sp["mtp"] = params["mtp"]
    return sp


def _layers(sp, cfg, h_BTD, moe_impl):
    B, T, _ = h_BTD.shape
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    for lp in sp["layers"]:
        h_BTD, _ = tfm.layer(lp, cfg, h_BTD, q_pos, moe_impl=moe_impl)
    return h_BTD


class StageProgram:
    """The jitted F, B, I, W (and their raw functions, for overlapped pairs) of one chunk for
    one micro-batch shape and one MoE implementation. Build with :func:`stage_program`."""

    def __init__(self, cfg: ModelConfig, chunk: Chunk, moe_impl, loss_scale: float, mtp_weight: float = 0.0):
        self.cfg, self.chunk, self.moe_impl, self.loss_scale = cfg, chunk, moe_impl, loss_scale
        self.mtp_weight = mtp_weight if chunk.last else 0.0
        self._structure = None   # (treedef, kinds): filled when F is traced
        self.key = None          # the cache key (see stage_program)

    # ---- the stage as a differentiable function of (params, layer input) --------------------
    def _body(self, sp, h, tok):
        h = _layers(sp, self.cfg, h, self.moe_impl)
        if not self.chunk.last:
            return h
        g = tfm.final_hidden(sp, self.cfg, h)
        loss = next_token_loss_sum(tfm.logits_of(sp, g), tok) * self.loss_scale
        if self.mtp_weight:      # pdjax.loss's MTP term; loss_scale * b (T-1): this micro-batch's share
            b, T = tok.shape
            share = self.loss_scale * b * (T - 1)
            loss = loss + mtp_loss_mean(sp, self.cfg, g, tok, self.moe_impl) * self.mtp_weight * share
        return loss

    def _diff_params(self, sp):
        """The params the VJP is taken over (chunk 0's embedding lookup is differentiated by
        hand; the MTP modules' use of the embedding through the VJP)."""
        return {k: v for k, v in sp.items() if k != "embed" or self.mtp_weight}

    # ---- raw functions -----------------------------------------------------------------------
    def forward_fn(self, sp, x, tok):
        h_in = tfm.embed(sp, x, self.cfg) if self.chunk.first else x
        y, vjp = jax.vjp(lambda p, h: self._body(p, h, tok), self._diff_params(sp), h_in)
        leaves, treedef = jax.tree.flatten(vjp)
        param_ids = {id(p): i for i, p in enumerate(jax.tree.leaves(sp))}
        kinds, res = [], []
        for leaf in leaves:
            if id(leaf) in param_ids:
                kinds.append(("param", param_ids[id(leaf)]))
            elif leaf is x and not self.chunk.first:
                kinds.append(("input", 0))
            else:
                kinds.append(("res", len(res)))
                res.append(leaf)
        if self._structure is None:      # fixed by build(); later traces (pairs) find the same
            self._structure = (treedef, tuple(kinds))
        return y, res

    def backward_fn(self, sp, x, res, gy):
        """(grads with the structure of ``sp``, gx); gx is the cotangent at the layer input
        (the embedding output on chunk 0)."""
        treedef, kinds = self._structure
        pl = jax.tree.leaves(sp)
        leaves = [pl[i] if k == "param" else x if k == "input" else res[i] for k, i in kinds]
        g_diff, g_in = jax.tree.unflatten(treedef, leaves)(gy)
        grads = dict(g_diff)
        if self.chunk.first:
            looked_up = jnp.zeros_like(sp["embed"]).at[x].add(g_in.astype(sp["embed"].dtype))
            grads["embed"] = looked_up + grads["embed"] if "embed" in grads else looked_up
        return {k: grads[k] for k in sp}, g_in

    # ---- building ---------------------------------------------------------------------------
    def build(self, sp_shapes, x_shape, tok_shape):
        """Trace F (abstractly) and cut the backward's jaxpr into I and W."""
        y_shape, res_shapes = jax.eval_shape(self.forward_fn, sp_shapes, x_shape, tok_shape)
        self.x_shape, self.y_shape, self.res_shapes = x_shape, y_shape, res_shapes
        gy_shape = jax.ShapeDtypeStruct(y_shape.shape, y_shape.dtype)
        self.split = _split_backward(self.backward_fn, (sp_shapes, x_shape, res_shapes, gy_shape))
        self.F = jax.jit(self.forward_fn)
        self.B = jax.jit(self.full_backward_fn, donate_argnums=(0,))
        self.I = jax.jit(self.input_backward_fn)
        self.W = jax.jit(self.weight_backward_fn, donate_argnums=(0,))
        return self

    def _input(self, x):
        """The stage input, or a stand-in when the backward does not read it (not kept)."""
        return jnp.zeros(self.x_shape.shape, self.x_shape.dtype) if x is None else x

    def full_backward_fn(self, acc, sp, x, res, gy):
        grads, gx = self.backward_fn(sp, self._input(x), res, gy)
        return jax.tree.map(jnp.add, acc, grads), (None if self.chunk.first else gx)

    def input_backward_fn(self, sp, x, res, gy):
        outs, carry = self.split.run_input(sp, self._input(x), res, gy)
        return (None if self.chunk.first else outs), carry

    def weight_backward_fn(self, acc, sp, kept, carry):
        """``kept``: the values of ``[x, *res, gy]`` at :attr:`w_keep` (what W reads)."""
        grads = self.split.run_weight(sp, kept, carry)
        return jax.tree.map(jnp.add, acc, grads)

    @property
    def keeps_input(self) -> bool:
        """Whether the backward reads the stage input (so the forward must keep it)."""
        return 0 in self.split.reads

    @property
    def w_keep(self) -> tuple[int, ...]:
        """Positions in ``[x, *res, gy]`` the W program reads: what an I must keep for it."""
        return self.split.w_keep


class _BackwardSplit:
    """A backward function's jaxpr cut into the equations the input gradient needs (I) and
    the rest (W), with the values that flow from I to W (the carry)."""

    def __init__(self, closed, out_tree, num_param_leaves: int):
        jaxpr = closed.jaxpr
        self.closed, self.out_tree = closed, out_tree
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        outs = jaxpr.outvars
        n_grads = out_tree.num_leaves - 1    # the last output leaf is gx
        grad_outs, gx_outs = outs[:n_grads], outs[n_grads:]
        i_set = _slice(jaxpr, producer, gx_outs)
        w_set = _slice(jaxpr, producer, grad_outs) - i_set
        self.i_eqns = [jaxpr.eqns[i] for i in sorted(i_set)]
        self.w_eqns = [jaxpr.eqns[i] for i in sorted(w_set)]
        # every variable W reads (or returns as a gradient), in first-use order
        w_reads = dict.fromkeys(v for v in [*(u for e in self.w_eqns for u in e.invars), *grad_outs]
                                if isinstance(v, jcore.Var))
        self.carry = [v for v in w_reads if producer.get(v) in i_set]
        self.grad_outs, self.gx_outs = grad_outs, gx_outs
        self.invars = jaxpr.invars
        values = jaxpr.invars[num_param_leaves:]          # [x, *res, gy]
        self.w_keep = tuple(i for i, v in enumerate(values) if v in w_reads)
        reads = set(w_reads) | {v for e in self.i_eqns for v in e.invars if isinstance(v, jcore.Var)}
        reads |= {v for v in outs if isinstance(v, jcore.Var)}
        self.reads = tuple(i for i, v in enumerate(values) if v in reads)
        self.kept_vars = [values[i] for i in self.w_keep]
        self.param_vars = jaxpr.invars[:num_param_leaves]

    def _env(self, args):
        env = dict(zip(self.closed.jaxpr.constvars, self.closed.consts))
        env.update(zip(self.invars, jax.tree.leaves(args)))
        return env

    def run_input(self, *args):
        env = self._env(args)
        read = _eval_eqns(self.i_eqns, env)
        return read(self.gx_outs[0]), [read(v) for v in self.carry]

    def run_weight(self, sp, kept, carry):
        env = dict(zip(self.closed.jaxpr.constvars, self.closed.consts))
        env.update(zip(self.param_vars, jax.tree.leaves(sp)))
        env.update(zip(self.kept_vars, kept))
        env.update(zip(self.carry, carry))
        read = _eval_eqns(self.w_eqns, env)
        grads = [read(v) for v in self.grad_outs]
        return jax.tree.unflatten(self.out_tree.children()[0], grads)


def _slice(jaxpr, producer, outs) -> set[int]:
    """Indices of the equations ``outs`` depend on."""
    need: set[int] = set()
    stack = [v for v in outs if isinstance(v, jcore.Var)]
    seen = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is None or i in need:
            continue
        need.add(i)
        stack.extend(u for u in jaxpr.eqns[i].invars if isinstance(u, jcore.Var))
    return need


def _eval_eqns(eqns, env):
    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for e in eqns:
        params = e.primitive.get_bind_params(e.params)
        with e.ctx.manager:
            ans = e.primitive.bind(*map(read, e.invars), **params)
        if e.primitive.multiple_results:
            env.update(zip(e.outvars, ans))
        else:
            env[e.outvars[0]] = ans
    return read


def _split_backward(fn, arg_shapes) -> _BackwardSplit:
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*arg_shapes)
    _, out_tree = jax.tree.flatten(out_shape)
    return _BackwardSplit(closed, out_tree, len(jax.tree.leaves(arg_shapes[0])))


_PROGRAMS: dict = {}
_LOCK = threading.Lock()


def stage_program(cfg: ModelConfig, chunk: Chunk, moe_impl, loss_scale: float, sp_shapes, x_shape,
                  tok_shape, mtp_weight: float = 0.0) -> StageProgram:
    """The (cached) programs of ``chunk`` for these shapes: executors with the same model cut
    share their traces and backward splits."""
    key = (cfg, chunk, moe_impl, float(loss_scale), float(mtp_weight), _shape_key(sp_shapes), _shape_key(x_shape),
           _shape_key(tok_shape))
    with _LOCK:
        prog = _PROGRAMS.get(key)
        if prog is None:
            prog = _PROGRAMS[key] = StageProgram(cfg, chunk, moe_impl, loss_scale, mtp_weight).build(
                sp_shapes, x_shape, tok_shape)
            prog.key = key
    return prog


def _shape_key(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)



class PairProgram:
    """An overlapped F&B: one micro-batch's forward (``fwd``, a :class:`StageProgram`) and
    another's backward (``bwd``; kind "B" or "I") in one jitted program, so XLA can
    interleave the two (and hide one's communication under the other's compute)."""

    def __init__(self, fwd: StageProgram, bwd: StageProgram, kind: str):
        self.fwd, self.bwd, self.kind = fwd, bwd, kind
        if kind == "B":
            self.fn = jax.jit(self._with_full, donate_argnums=(3,))
        else:
            self.fn = jax.jit(self._with_input)

    def _with_full(self, sp_f, x_f, tok_f, acc, sp_b, x_b, res_b, gy_b):
        return self.fwd.forward_fn(sp_f, x_f, tok_f), self.bwd.full_backward_fn(acc, sp_b, x_b, res_b, gy_b)

    def _with_input(self, sp_f, x_f, tok_f, sp_b, x_b, res_b, gy_b):
        return self.fwd.forward_fn(sp_f, x_f, tok_f), self.bwd.input_backward_fn(sp_b, x_b, res_b, gy_b)


_PAIRS: dict = {}


def clear_caches() -> None:
    """Forget every cached stage and pair program."""
    with _LOCK:
        _PROGRAMS.clear()
        _PAIRS.clear()


def pair_program(fwd: StageProgram, bwd: StageProgram, kind: str) -> PairProgram:
    """The (cached) overlapped pair of two stage programs."""
    key = (fwd.key, bwd.key, kind)
    with _LOCK:
        if key not in _PAIRS:
            _PAIRS[key] = PairProgram(fwd, bwd, kind)
            _PAIRS[key].key = key
        return _PAIRS[key]
