"""The prefill pool: runs a prompt layer by layer on its own mesh and pushes each layer's
latent KV to the decode pool as soon as that layer is done.

A prompt of T tokens is padded to a bucket (a multiple of the mesh size, so the MoE tokens
split evenly; powers of two to bound recompiles). Attention runs replicated over the prefill
devices and the MoE layers expert-parallel (tokens split over the mesh: small EP). After
layer l the real rows ``[T, C+R]`` of its latent cache are sliced off (no padding is sent) and
handed to ``jax.device_put`` towards the decode rank that reserved the request's blocks; the
call is asynchronous, so the copy of layer l proceeds while layer l+1 computes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.compilation import announce
from pdjax.model_config import ModelConfig
from pdjax.disagg.sampling import sample
from pdjax.model import mtp
from pdjax.model.dots import logits_of
from pdjax.model.transformer import embed, final_hidden, head, layer
from pdjax.parallel.ep import ExpertParallel
from pdjax.parallel.mesh import make_mesh, shard_params


def _placed(outputs, out):
    """Both layer programs return (x, kv) replicated over the pool's mesh (``out``; None: as
    XLA places them), as their inputs are: an MoE layer's would otherwise come out split over
    the expert axis, and the next layer, seeing another input sharding, would compile a
    second program for the same shapes."""
    return outputs if out is None else jax.lax.with_sharding_constraint(outputs, out)


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl", "out"))
def _layer(lp, cfg, x, q_pos, valid, moe_impl, out):
    return _placed(layer(lp, cfg, x, q_pos, moe_impl=moe_impl, valid_BT=valid), out)


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl", "out"), donate_argnames=("kv",))
def _layer_cached(lp, cfg, x, q_pos, kv, start, valid, moe_impl, out):
    """A layer over a chunk that continues the request's cache kv [1, S, C+R] (rows before
    ``start`` filled): the chunk's rows are written at ``start`` (kv is donated: in place) and
    it attends causally."""
    return _placed(layer(lp, cfg, x, q_pos, kv, start, moe_impl=moe_impl, valid_BT=valid), out)


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl", "out"), donate_argnames=("kv",))
def _mtp_layer(heads, cfg, x, follow, q_pos, kv, start, valid, last, moe_impl, out):
    """MTP depth 1 over a chunk: from the main model's last-layer states ``x`` and the tokens
    that follow each position, its rows (a fresh [1, Tb, C+R] when ``kv`` is None, else
    written into ``kv`` at ``start``, donated) and its greedy draft at chunk row ``last``."""
    g1, kv = mtp.depth_block(heads[mtp.MTP][0], cfg, embed(heads, follow, cfg), final_hidden(heads, cfg, x), q_pos,
                             layer, kv, start, moe_impl=moe_impl, valid_BT=valid)
    draft = jnp.argmax(logits_of(heads, g1[:, last]), axis=-1).astype(jnp.int32)
    return _placed((draft, kv), out)


@functools.partial(jax.jit, static_argnames=("size",))
def _cache_buffer(prefix_rows, size):
    """[1, size, C+R] zeros with the cached prefix rows at the front."""
    buf = jnp.zeros((1, size, prefix_rows.shape[1]), prefix_rows.dtype)
    return jax.lax.dynamic_update_slice(buf, prefix_rows[None], (0, 0, 0))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params, cfg, tokens):
    return embed(params, tokens, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _first_token(params, cfg, x, last, temperature, top_p, seed):
    logits = head(params, cfg, x[:, last])
    return sample(logits, temperature, top_p, seed, jnp.zeros_like(seed))


def bucket(n: int, multiple: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum), rounded up to a multiple of ``multiple``."""
    b = 1 << (max(n, minimum) - 1).bit_length()
    return -(-b // multiple) * multiple


def chunk_plan(total: int, start: int, chunk) -> list[tuple[int, int]]:
    """[(position, tokens)] covering prompt positions start..total-1. ``chunk``: None (one
    chunk), an int (at most that many tokens per chunk) or a callable ``chunk(position) ->
    tokens`` (e.g. the largest chunk that fits a time budget under a fitted cost, given the
    tokens already in the cache); each chunk has at least one token."""
    plan, pos = [], start
    while pos < total:
        q = total - pos if chunk is None else int(chunk if isinstance(chunk, int) else chunk(pos))
        q = min(max(q, 1), total - pos)
        plan.append((pos, q))
        pos += q
    return plan


def _flush(sends: list, push) -> None:
    """Make the pushes a locked chunk recorded, in order, now that the lock is released."""
    for args in sends:
        push(*args)
    sends.clear()


class PrefillPool:
    """``speculative="mtp"``: after the prompt, the MTP module (depth 1) runs over it too
    (each position with the token after it, the last with the first generated token): its
    rows are pushed as one more layer (index ``num_hidden_layers``) and its draft of the
    second generated token is left in ``req.mtp_draft``."""

    def __init__(self, params, cfg: ModelConfig, devices, mesh_axes: dict, speculative: str | None = None):
        self.cfg, self.speculative = cfg, speculative
        self.mesh = make_mesh(mesh_axes, devices)
        self.size = math.prod(self.mesh.shape.values())
        self.ep = ExpertParallel(self.mesh) if "expert" in self.mesh.axis_names else None
        self.params = shard_params(params, cfg, self.mesh)
        self.heads = {k: self.params[k] for k in ("embed", "final_norm", "lm_head", mtp.MTP) if k in self.params}
        self.replicated = NamedSharding(self.mesh, P())
        self._warm: set = set()          # the (program, shapes) this pool has run: compiled
        # per thread (an abandoned run may still be finishing while a new one starts): the
        # running prefill's on_compile(True / False), called around a cold call
        self._run_state = threading.local()

    def _program(self, key, fn, *args):
        """``fn(*args)``; when ``key`` (a program and its shapes) has not run on this pool yet,
        the call compiles first: the run's ``on_compile`` hears of it before and after."""
        on_compile = getattr(self._run_state, "on_compile", None)
        if key in self._warm:
            return fn(*args)
        notes = getattr(self._run_state, "compile_note", None)
        if notes is not None and not notes.entered:     # one progress line per run that compiles
            notes.entered = True
            notes.enter_context(announce("the prefill's programs for a new prompt length"))
        if on_compile is None:     # not marked warm: a run that reports compiles hears of this one
            return fn(*args)
        on_compile(True)
        try:
            return fn(*args)
        finally:
            self._warm.add(key)
            on_compile(False)

    def _put(self, a):
        return jax.device_put(a, self.replicated)

    def run(self, req, push, prefix=None, timeline=None, chunk=None, step_lock=None, chunk_times=None,
            on_compile=None):
        """Prefill ``req``; call ``push(layer, rows, start)`` with each layer's latent rows
        [q, C+R] for prompt positions start..start+q-1 right after that layer is dispatched
        (the first chunk's rows include a cached prefix's: the decode side needs them all).
        Returns (first generated token, per layer the rows of the whole prompt [T, C+R]; with
        ``speculative``, the MTP layer's last).

        ``prefix``: (P, iterator of (layer, rows [P, C+R]) on this pool's devices) for a
        cached prefix of P tokens: only the remaining T - P tokens are computed, each layer
        attending to its prefix rows, which the iterator delivers layer by layer.
        ``chunk``: see :func:`chunk_plan`; the chunks run one after another, each through all
        layers, attending to the rows of the earlier ones (``req.prefill_chunks`` records the
        sizes). ``step_lock``: a context manager held around each chunk's compute (a
        colocated pool lets decode steps run between chunks); no lock is held across a
        transport call: under a lock, a chunk's ``push`` calls run once it is released, so a
        stalled send never blocks the decode steps (nor the deadline that cancels it).
        ``timeline``: a :class:`pdjax.disagg.device_spans.DeviceSpans` to record each layer's compute.
        ``chunk_times``: a list to append each chunk's wall seconds to (the chunk is waited
        for, so only for calibration). ``on_compile(active)``: called before (True) and after
        (False) a call that compiles a program this pool has not run yet (the decode side
        keeps compile time out of its handoff deadline)."""
        self._run_state.on_compile = on_compile
        self._run_state.compile_note = notes = contextlib.ExitStack()
        notes.entered = False
        try:
            with notes:
                return self._run(req, push, prefix, timeline, chunk, step_lock, chunk_times)
        finally:
            self._run_state.on_compile = self._run_state.compile_note = None

    def _run(self, req, push, prefix, timeline, chunk, step_lock, chunk_times):
        T = len(req.prompt)
        P, loaded = prefix if prefix else (0, None)
        # speculative: the cached MTP row of the prefix's last position was made with the
        # token after it in the prompt that stored it; the main model reruns that position
        # (its state feeds the MTP layer) and the MTP layer rewrites the row
        P -= bool(self.speculative and P)
        plan = chunk_plan(T, P, chunk)
        req.prefill_chunks = [q for _, q in plan]
        sends: list = []                                 # a locked chunk's pushes, made after it
        if step_lock is None:
            step_lock, send = contextlib.nullcontext(), push
        else:
            send = lambda *args: sends.append(args)      # noqa: E731
        if loaded is None and len(plan) == 1:            # the whole prompt, no cache: one pass
            t0 = time.perf_counter()
            with step_lock:
                x, rows = self._fresh(req.prompt, send, timeline)
            _flush(sends, push)
            if chunk_times is not None:
                x.block_until_ready()
                chunk_times.append(time.perf_counter() - t0)
            return self._finish(req, [(0, T, x)], rows, None, send, step_lock, sends, push)
        size = max(pos + bucket(q, self.size) for pos, q in plan)
        size = bucket(size, self.size)
        kvs = [None] * len(self.params["layers"])
        xs = []
        for pos, q in plan:
            t0 = time.perf_counter()
            with step_lock:
                x = self._chunk(req.prompt, pos, q, P, kvs, size, loaded, send, timeline)
                if chunk_times is not None:
                    x.block_until_ready()
                    chunk_times.append(time.perf_counter() - t0)
            _flush(sends, push)
            xs.append((pos, q, x))
        return self._finish(req, xs, [kv[0, :T] for kv in kvs], size, send, step_lock, sends, push, loaded)

    def _finish(self, req, xs, rows, size, send, step_lock, sends, push, loaded=None):
        """(first token, rows) of a prefill whose chunks' last-layer states are ``xs``
        [(position, tokens, x)]; with ``speculative``, the MTP layer runs over those chunks
        in order (into a cache of ``size`` rows, or fresh for one unchunked pass; a cached
        prefix's MTP rows, the last layer ``loaded`` delivers, in front), its rows sent (the
        first chunk's with the prefix's) and appended to ``rows``, its draft left in
        ``req.mtp_draft``."""
        first = self._first_token(req, xs[-1][2], xs[-1][1] - 1)
        if not self.speculative:
            return first, rows
        follow = list(req.prompt[1:]) + [first]
        L, kv = self.cfg.num_hidden_layers, None
        if loaded is not None:
            layer_idx, prefix_rows = next(loaded)
            assert layer_idx == L, (layer_idx, L)
            kv = self._program(("prefix", prefix_rows.shape, size), _cache_buffer, prefix_rows, size)
        elif size is not None:
            kv = jnp.zeros((1, size, self.cfg.kv_latent_dim), self.params["embed"].dtype, device=self.replicated)
        for i, (pos, q, x) in enumerate(xs):
            tokens, q_pos, valid = self._inputs(follow, pos, q)
            start = None if kv is None else self._put(np.array([pos], np.int32))
            with step_lock:
                draft, out = self._program(("mtp", x.shape, None if kv is None else kv.shape), _mtp_layer,
                                           self.heads, self.cfg, x, tokens, q_pos, kv, start, valid, q - 1,
                                           self.ep, self.replicated)
                lo = 0 if i == 0 else pos
                send(L, out[0, lo:pos + q] if kv is not None else out[0, :q], lo)
            _flush(sends, push)
            kv = None if kv is None else out           # (an unchunked pass has one chunk)
        req.mtp_draft = int(np.asarray(draft)[0])
        return first, rows + [out[0, :len(req.prompt)]]

    def _chunk(self, prompt, pos: int, q: int, P: int, kvs: list, size: int, loaded, send, timeline):
        """Prompt positions pos..pos+q-1 through every layer, each continuing its cache
        ``kvs[l]`` (made on the first chunk: the cached prefix's rows from ``loaded``, or
        zeros, ``size`` rows) and sending its new rows (the first chunk also the prefix's).
        Returns the chunk's hidden states."""
        tokens, q_pos, valid = self._inputs(prompt, pos, q)
        start = self._put(np.array([pos], np.int32))
        Tb = tokens.shape[1]
        x = self._program(("embed", Tb), _embed, self.params, self.cfg, tokens)
        for l, lp in enumerate(self.params["layers"]):
            if kvs[l] is None:
                if loaded is not None:
                    layer_idx, prefix_rows = next(loaded)
                    assert layer_idx == l, (layer_idx, l)
                    kvs[l] = self._program(("prefix", prefix_rows.shape, size), _cache_buffer, prefix_rows, size)
                else:
                    kvs[l] = jnp.zeros((1, size, self.cfg.kv_latent_dim), self.params["embed"].dtype,
                                       device=self.replicated)
            x, kvs[l] = self._program(("layer", l, Tb, size), _layer_cached, lp, self.cfg, x, q_pos, kvs[l], start,
                                      valid, self.ep, self.replicated)
            if timeline is not None:
                timeline.record("prefill compute", f"layer {l}", x)
            lo = 0 if pos == P else pos           # the first chunk also sends the cached prefix
            send(l, kvs[l][0, lo:pos + q], lo)
        return x

    def _inputs(self, prompt, pos: int, q: int):
        """Tokens pos..pos+q-1 padded to their bucket, their positions, and the validity mask
        (the bucket's padding stays off the experts), on the pool's devices."""
        Tb = bucket(q, self.size)
        tokens = np.zeros((1, Tb), np.int32)
        tokens[0, :q] = prompt[pos:pos + q]
        q_pos = (pos + np.arange(Tb, dtype=np.int32))[None]
        return self._put(tokens), self._put(q_pos), self._put((np.arange(Tb) < q)[None])

    def _fresh(self, prompt, push, timeline):
        T = len(prompt)
        tokens, q_pos, valid = self._inputs(prompt, 0, T)
        Tb = tokens.shape[1]
        x = self._program(("embed", Tb), _embed, self.params, self.cfg, tokens)
        rows = []
        for l, lp in enumerate(self.params["layers"]):
            x, kv = self._program(("fresh layer", l, Tb), _layer, lp, self.cfg, x, q_pos, valid, self.ep,
                                  self.replicated)
            rows.append(kv[0, :T])
            if timeline is not None:
                timeline.record("prefill compute", f"layer {l}", x)
            push(l, rows[-1], 0)
        return x, rows

    def _first_token(self, req, x, last):
        s = req.sampling
        tok = self._program(("first token", x.shape), _first_token, self.params, self.cfg, x, last,
                            jnp.float32([s.temperature]), jnp.float32([s.top_p]), jnp.int32([s.seed]))
        return int(np.asarray(tok)[0])
