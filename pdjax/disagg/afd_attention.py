"""The attention side of AF disaggregation: a decode pool whose MoE layers' routed experts run
on an FFN pool, m ping-pong micro-batches at a time.

:class:`AFDPool` is a :class:`~pdjax.disagg.decode.DecodePool` (paged latent cache, slots,
:class:`~pdjax.disagg.decode.SlotState`, the handoff protocol, driven by the one
:class:`~pdjax.disagg.scheduler.DecodeScheduler`), data-parallel over its M devices, with
another ``step``. Micro-batch j holds, on every attention rank, the j-th of m equal runs of
that rank's slots (slot = rank * slots/M + j * slots/(M m) + i). A step cuts the model at
its MoE layers into *segments*: segment k runs, on the attention mesh, the fold of the
previous MoE layer's output (x + (routed + shared)), the dense layers before MoE layer k,
the attention half of MoE layer k, its norm, the router and the shared experts; the last
segment runs the dense layers after the last MoE layer and the head. Between segments a
micro-batch's normed hidden states and routing go to the FFN pool (A2F, through the
exchange seam), its routed experts run there, and the output comes back (F2A).

The host issues, per segment, micro-batch 0's attention, exchange, experts and return, then
micro-batch 1's, ...: every call is an asynchronous dispatch on disjoint device sets, so
micro-batch j+1's attention runs while micro-batch j crosses and computes on the FFN side.
A step's one host read is the sampled tokens. An FFN call or exchange that raises fails its
micro-batch's chain: it is run again from the start of the step (its KV rows are rewritten
with the same values) up to ``ffn_retries`` times, then its running requests end with a
:class:`~pdjax.disagg.request.RequestError` and the other micro-batches' tokens stand.

The exchange is checked end to end (:func:`~pdjax.disagg.afd_ffn.seal`): each side's
program checksums what it sends and the receiving program compares, on device; a
micro-batch's count of corrupt pieces travels with its carry and is read with the tokens
(the same one host read: [slots + m]), so no layer waits on the host. A micro-batch with a
corrupt piece is run again from the step's unchanged inputs (its KV rows rewritten) and
the step sampled again from the slot state before it (kept: the sampling is a function of
it, so the tokens are the ones a clean step gives), up to ``ffn_retries`` times; then its
requests fail. ``stats["exchange_corrupt"]`` counts the detections.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.disagg.afd_ffn import FFNPool, MeshExchange, join_local, seal, split_local, unseal
from pdjax.disagg.decode import DecodePool, advance_slots
from pdjax.disagg.request import RequestError
from pdjax.model import moe as moe_lib
from pdjax.model.mla import rms_norm
from pdjax.model.paged import PagedLayer
from pdjax.model.transformer import attention_block, embed, head, layer


class FFNError(RuntimeError):
    """The FFN side (or the exchange) failed a micro-batch at MoE layer ``layer``."""

    def __init__(self, layer: int, microbatch: int, cause: BaseException):
        super().__init__(f"the FFN side failed at MoE layer {layer}, micro-batch {microbatch}: "
                         f"{type(cause).__name__}: {cause}")
        self.layer, self.microbatch = layer, microbatch


class ExchangeCorrupt(RuntimeError):
    """A piece of micro-batch ``microbatch`` crossed the AF exchange corrupt (checksum)."""

    def __init__(self, microbatch: int):
        super().__init__(f"the AF exchange delivered a corrupt payload to micro-batch {microbatch} "
                         "(a checksum mismatch)")
        self.microbatch = microbatch


@contextlib.contextmanager
def _ffn_errors(layer: int, microbatch: int):
    """Whatever the FFN side or the exchange raises becomes an FFNError of the micro-batch."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - an FFN rank or the exchange failed this micro-batch
        raise FFNError(layer, microbatch, e) from e


@contextlib.contextmanager
def _noting_failure(microbatch: int, failed: dict):
    """An FFNError of the micro-batch goes into ``failed`` (its chain stops for this step)."""
    try:
        yield
    except FFNError as e:
        failed[microbatch] = e


def segments(cfg: ModelConfig) -> list[tuple[tuple[int, ...], int | None]]:
    """[(dense layers, MoE layer)] in order, then (the dense layers after the last MoE
    layer, None): where the attention side hands a micro-batch to the FFN side."""
    out, dense = [], []
    for l in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(l):
            out.append((tuple(dense), l))
            dense = []
        else:
            dense.append(l)
    return out + [(tuple(dense), None)]


@functools.partial(jax.jit, static_argnames=("ranks", "m"))
def _microbatches(tokens, tables, lengths, valid, ranks, m):
    """Per micro-batch j: (last tokens, (block tables, lengths, valid)) of its slots, rank-major."""
    def part(a, j):
        return a.reshape((ranks, m, -1) + a.shape[1:])[:, j].reshape((-1,) + a.shape[1:])
    return tuple((part(tokens, j), tuple(part(a, j) for a in (tables, lengths, valid))) for j in range(m))


@functools.partial(jax.jit, static_argnames=("cfg", "paging", "parts"), donate_argnames=("pools",))
def _segment(ends, layers, cfg, carry, pools, mb, paging, parts):
    """One segment of one micro-batch (see the module docstring). ``ends``: the embedding
    (first segment; ``carry`` the tokens [b]) and/or the final norm and LM head (last);
    otherwise ``carry`` = (x [b,1,D], shared-expert output [b,D], corrupt pieces so far [M],
    sealed routed output pieces: unsealed and counted here). Returns ((x, shared, corrupt),
    sealed A2F piece arrays of (normed x, weights, ids, valid)) or (the logits [b,V] float32,
    corrupt), and the layers' pools (donated: updated in place)."""
    mesh, axes, view_blocks = paging
    tables, start, valid = mb
    if "embed" in ends:
        x = embed(ends, carry, cfg)[:, None]
        bad = jax.lax.with_sharding_constraint(jnp.zeros(mesh.devices.size, jnp.int32),
                                               NamedSharding(mesh, P(tuple(mesh.axis_names))))
    else:
        x, shared, bad, routed = carry
        routed, corrupt = unseal(routed, mesh)
        bad = bad + sum(corrupt)
        x = x + (join_local(routed, mesh) + shared)[:, None]
    q_pos, new = start[:, None], []
    for lp, pool in zip(layers, pools):
        kv = PagedLayer(pool, tables, mesh, axes, view_blocks)
        if "moe" in lp:                      # the segment's MoE layer: its experts run on the FFN side
            x, kv = attention_block(lp, cfg, x, q_pos, kv, start, absorbed=True)
            u = rms_norm(x, lp["ffn_norm"], cfg.rms_norm_eps)[:, 0]
            weights, ids = moe_lib.route(lp["moe"], cfg, u, valid)
            shared = moe_lib.shared_experts(lp["moe"], cfg, u)
            pieces = split_local((u, weights, ids, valid), parts, mesh)
            return ((x, shared, bad), seal(pieces, mesh)), tuple(new + [kv.pool])
        x, kv = layer(lp, cfg, x, q_pos, kv, start, absorbed=True, valid_BT=valid[:, None])
        new.append(kv.pool)
    return (head(ends, cfg, x)[:, 0], bad), tuple(new)


@functools.partial(jax.jit, static_argnames=("ranks", "sampling"))
def _finish(outs, state, lengths, ranks, sampling):
    """The micro-batches' logits back in slot order [slots, V]; sample, advance the slots
    (:func:`~pdjax.disagg.decode.advance_slots`), every slot's length + 1 (as the model's
    decode step). ``outs``: per micro-batch (logits, corrupt pieces [M]). Returns (the tokens
    [slots] followed by each micro-batch's corrupt-piece count [m], state, lengths, logits);
    ``state`` and ``lengths`` are not donated: a corrupt step is sampled again from them."""
    logits = [l for l, _ in outs]
    V = logits[0].shape[-1]
    logits_SV = jnp.stack(logits).reshape(len(logits), ranks, -1, V).transpose(1, 0, 2, 3).reshape(-1, V)
    toks, state = advance_slots(logits_SV, state, sampling)
    corrupt = jnp.stack([b.sum() for _, b in outs]).astype(toks.dtype)
    return jnp.concatenate([toks, corrupt]), state, lengths + 1, logits_SV


def _attention_params(lp: dict) -> dict:
    """What the attention side reads of a layer: all of a dense layer; of a MoE layer all
    but the routed experts (the router and the shared experts stay)."""
    if "moe" not in lp:
        return lp
    return {**lp, "moe": {k: v for k, v in lp["moe"].items() if k in ("router", "router_bias", "shared")}}


class AFDPool(DecodePool):
    """See the module docstring. ``ffn_devices``: the FFN pool's devices (the routed experts
    must divide over them); ``microbatches``: m; ``ffn_retries``: reruns of a micro-batch
    whose FFN call failed before its requests fail; ``remote_ffn``: instead of ``ffn_devices``,
    a :class:`~pdjax.disagg.afd_process.RemoteFFN` (the FFN side in another process). ``slots`` must split into m equal runs
    on every attention rank, and a micro-batch's rows (slots/m) over the FFN ranks."""

    def __init__(self, params, cfg: ModelConfig, devices, mesh_axes: dict, *, ffn_devices=None, remote_ffn=None,
                 microbatches: int, ffn_retries: int = 1, **options):
        super().__init__(params, cfg, devices, mesh_axes, **options)
        self.m, self.ffn_retries = microbatches, ffn_retries
        if remote_ffn is not None:                 # the FFN side in another process: one object, both seams
            remote_ffn.bind(self.mesh, self.params)
            self.ffn = self.exchange = remote_ffn
        else:
            self.ffn = FFNPool(self.params, cfg, list(ffn_devices))
            self.exchange = MeshExchange(self.mesh, self.ffn.mesh)
        self.segments = segments(cfg)
        self.layers = [_attention_params(lp) for lp in self.params["layers"]]
        p = self.params
        self.ends = [{"embed": p["embed"]}] + [{}] * (len(self.segments) - 2) + [
            {"final_norm": p["final_norm"], "lm_head": p["lm_head"]}]
        self.logits = None           # the last step's logits [slots, V] (on device, never fetched)
        self.begin()

    def begin(self, timeline=None) -> None:
        """Start counting (``stats``) afresh; record each stage on ``timeline`` if given."""
        self.timeline, self.steps = timeline, 0
        moe = [l for _, l in self.segments if l is not None]
        self.stats = {"a2f_bytes": dict.fromkeys(moe, 0), "routing_bytes": dict.fromkeys(moe, 0),
                      "f2a_bytes": dict.fromkeys(moe, 0), "check_bytes": 0, "ffn_failures": 0,
                      "ffn_retries_ok": 0, "exchange_corrupt": 0}

    def microbatch(self, slot: int) -> int:
        """The micro-batch ``slot`` runs in."""
        per = self.slots // self.ranks
        return (slot % per) // (per // self.m)

    def step(self) -> dict:
        """One decode step of every slot, m micro-batches in ping-pong; returns {slot: token}
        for the running slots ({slot: RequestError} where the FFN side failed them)."""
        active = self.active
        if not active:
            return {}
        c = self.cache
        mbs = _microbatches(self.state.last_token, c.block_tables, c.lengths, self.state.valid, self.ranks, self.m)
        paging = (self.mesh, self.axes, self.view_blocks())
        carries, failed = [tokens for tokens, _ in mbs], {}
        for k in range(len(self.segments)):
            # every micro-batch's attention and A2F, then every one's experts and F2A: issued in
            # the order they can run (XLA:CPU starts multi-device programs in issue order)
            sent = {}
            for j in range(self.m):
                if j not in failed:
                    with _noting_failure(j, failed):
                        sent[j] = self._attend(k, j, carries[j], mbs[j][1], paging)
            for j, out in sent.items():
                with _noting_failure(j, failed):
                    carries[j] = self._round_trip(k, j, out)
        for j in list(failed):
            self._rerun(j, mbs[j], paging, carries, failed)
        sampling = any(self.slot_req[s].request.sampling.temperature > 0 for s in active)
        toks = self._sample(mbs, paging, carries, failed, sampling)
        self.steps += 1
        self.kv_len[active] += 1
        return {s: self._failure(s, failed[self.microbatch(s)]) if self.microbatch(s) in failed else int(toks[s])
                for s in active}

    def _sample(self, mbs, paging, carries: list, failed: dict, sampling: bool):
        """Sample the step (the host read of the tokens and the corrupt-piece counts). A
        micro-batch with a corrupt piece is run again (:meth:`_chain`) and the step sampled
        again from the state before it, up to ``ffn_retries`` times; then it is failed."""
        state, lengths = self.state, self.cache.lengths
        for tries in itertools.count():
            toks, new_state, new_lengths, logits = _finish(tuple(carries), state, lengths, self.ranks, sampling)
            toks = jax.device_get(toks)
            corrupt = [j for j in range(self.m) if toks[self.slots + j]]
            if not corrupt:
                break
            self.stats["exchange_corrupt"] += len(corrupt)
            for j in corrupt:
                try:
                    if tries >= self.ffn_retries:
                        raise ExchangeCorrupt(j)
                    carries[j] = self._chain(j, mbs[j], paging)
                except (ExchangeCorrupt, FFNError) as e:
                    failed[j], carries[j] = e, self._dead()
        self.state, self.logits = new_state, logits
        self.cache = dataclasses.replace(self.cache, lengths=new_lengths)
        return toks

    def _chain(self, j: int, mb, paging):
        """Micro-batch j's whole step from its unchanged inputs (its KV rows are rewritten
        with the same values): its (logits, corrupt). Raises FFNError."""
        carry, ctx = mb
        for k in range(len(self.segments)):
            carry = self._round_trip(k, j, self._attend(k, j, carry, ctx, paging))
        return carry

    def _dead(self):
        """A failed micro-batch's (logits, corrupt): zeros (its requests are failed, not sampled)."""
        rows = self.slots // self.m
        return (jnp.zeros((rows, self.cfg.vocab_size), jnp.float32, device=self.batch_sharding),
                jnp.zeros(self.ranks, jnp.int32, device=NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))))

    def _rerun(self, j: int, mb, paging, carries: list, failed: dict) -> None:
        """Run micro-batch j's whole step again (:meth:`_chain`) up to ``ffn_retries`` times;
        if it still fails its requests are failed (:meth:`_dead`)."""
        self.stats["ffn_failures"] += 1
        for _ in range(self.ffn_retries):
            try:
                carries[j] = self._chain(j, mb, paging)
            except FFNError as e:
                failed[j] = e
                continue
            del failed[j]
            self.stats["ffn_retries_ok"] += 1
            return
        carries[j] = self._dead()

    def _failure(self, slot: int, error: Exception) -> RequestError:
        req = self.slot_req[slot].request
        return RequestError(f"request {req.index}: decode step failed {1 + self.ffn_retries} time(s): {error}")

    def _name(self, k: int, j: int) -> str:
        moe = self.segments[k][1]
        return f"step {self.steps} layer {moe if moe is not None else 'head'} mb {j}"

    def _attend(self, k: int, j: int, carry, ctx, paging):
        """Segment k of micro-batch j on the attention side, and (but for the last) the A2F
        of its MoE layer's input. Returns the logits, or ((x, shared), the input on the FFN
        side). Raises FFNError when the exchange does."""
        dense, moe = self.segments[k]
        ids = dense + ((moe,) if moe is not None else ())
        pools = list(self.cache.pools)
        out, new = _segment(self.ends[k], tuple(self.layers[l] for l in ids), self.cfg, carry,
                            tuple(pools[l] for l in ids), ctx, paging, self.exchange.parts(self.mesh))
        for l, pool in zip(ids, new):
            pools[l] = pool
        self.cache = dataclasses.replace(self.cache, pools=tuple(pools))
        self._record("attention", self._name(k, j), out, j)
        if moe is None:
            return out
        (x, shared, bad), payload = out
        with _ffn_errors(moe, j):
            sent, nbytes = self.exchange.to_ffn(payload)
        self.stats["a2f_bytes"][moe] += nbytes[0]              # the hidden states
        self.stats["routing_bytes"][moe] += sum(nbytes[1:-1])  # weights, expert ids, valid
        self.stats["check_bytes"] += nbytes[-1]                # the seals' checksums
        self._record("a2f", self._name(k, j), sent, j)
        return (x, shared, bad), sent

    def _round_trip(self, k: int, j: int, out):
        """The FFN side of segment k for micro-batch j and the F2A of its output: the next
        carry (x, shared, routed output on the attention side); the logits pass through.
        Raises FFNError when the FFN pool or the exchange does."""
        moe = self.segments[k][1]
        if moe is None:
            return out
        (x, shared, bad), sent = out
        with _ffn_errors(moe, j):
            routed = self.ffn(moe, sent)
            self._record("ffn", self._name(k, j), routed, j)
            back, nbytes = self.exchange.to_attention(routed)
        self.stats["f2a_bytes"][moe] += nbytes[0]
        self.stats["check_bytes"] += nbytes[-1]
        self._record("f2a", self._name(k, j), back, j)
        return x, shared, bad, back

    def _record(self, stream: str, name: str, array, microbatch: int) -> None:
        if self.timeline is not None:
            self.timeline.record(stream, name, array)["chain"] = (self.steps, microbatch)
