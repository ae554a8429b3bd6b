"""The decode pool: a paged latent cache on its own mesh, continuous batching over a fixed
set of slots, and the receiving end of the KV handoff.

Handoff protocol (decode side): ``reserve`` picks a DP rank and pre-allocates every block
the request will need (prompt + max_new_tokens) before the prefill starts; ``receive_layer``
writes each layer's latent rows into those blocks as they arrive; ``admit`` joins the
request to the running batch once all layers are in; ``release`` frees its blocks when it
finishes. Requests join and leave between steps. One thread drives a pool (the decode
scheduler's driver); prefill workers only read ``target_device``.

Per step, nothing crosses from the host: the slots' last tokens, sampling parameters,
generation counters and validity live on the devices (:class:`SlotState`, set by ``admit``
and ``release``, advanced inside the jitted step), and the host picks only the static number
of blocks the attention gathers (a bucket of the longest running slot's length, from the
``kv_len`` mirror), so a step's time follows the KV the batch holds, not the pool's
capacity. Fetching the sampled tokens is the step's one device-to-host transfer. Every
update of the pool, the block tables and the slot state is donated (in place).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.model_config import ModelConfig
from pdjax.disagg.request import Request
from pdjax.disagg.sampling import sample
from pdjax.disagg.spec_decode import spec_step
from pdjax.model.cache import scatter_rows
from pdjax.model.paged import BlockAllocator, init_paged_cache, view_bucket
from pdjax.model.transformer import decode_core
from pdjax.parallel.ep import ExpertParallel
from pdjax.parallel.mesh import make_mesh, shard_params


@dataclasses.dataclass
class Reservation:
    request: Request
    rank: int
    blocks: list
    rows_received: list = dataclasses.field(default_factory=list)   # per layer

    @property
    def complete(self) -> bool:
        """Every layer holds the whole prompt's rows."""
        T = len(self.request.prompt)
        return len(self.rows_received) > 0 and all(n == T for n in self.rows_received)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What a decode step needs per slot, kept on the pool's devices ([slots] each, split over
    the DP ranks like the slots): set by ``admit`` and ``release`` (small donated updates),
    advanced by the step itself, so a step copies nothing from the host."""

    last_token: jax.Array      # int32: the token the next step feeds
    temperature: jax.Array     # float32 (0 = greedy)
    top_p: jax.Array           # float32
    seed: jax.Array            # int32
    gen: jax.Array             # int32: generation index of the token the next step samples
    valid: jax.Array           # bool: the slot holds a running request
    draft: jax.Array           # int32: the MTP draft for the position after last_token (speculative)

    @classmethod
    def empty(cls, slots: int, sharding) -> "SlotState":
        """Every slot empty, placed with ``sharding`` (one buffer per field)."""
        def z(dtype):
            return np.zeros(slots, dtype)
        return jax.device_put(cls(z(np.int32), z(np.float32), np.ones(slots, np.float32), z(np.int32),
                                  z(np.int32), z(bool), z(np.int32)), sharding)

    def fields(self) -> tuple:
        """The arrays, in field order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl", "sampling"), donate_argnames=("cache", "state"))
def _step(params, cfg, cache, state, moe_impl, sampling=True):
    """One decode step of every slot: (sampled tokens [slots], cache, state advanced).
    ``sampling=False`` (static; every running slot greedy) takes the argmax, which is what
    :func:`pdjax.disagg.sampling.sample` returns at temperature 0, without its sort over the
    vocabulary (and without reducing the temperatures over the mesh to find out)."""
    logits, cache = decode_core(params, cfg, state.last_token, cache, moe_impl, state.valid)
    toks, state = advance_slots(logits, state, sampling)
    return toks, cache, state


def advance_slots(logits_SV, state: SlotState, sampling: bool):
    """Sample each slot's next token from its logits [slots, V] (the argmax when ``sampling``
    is False) and advance the running slots' state. Returns (tokens [slots], state)."""
    if sampling:
        toks = sample(logits_SV, state.temperature, state.top_p, state.seed, state.gen)
    else:
        toks = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
    state = dataclasses.replace(state, last_token=jnp.where(state.valid, toks, state.last_token),
                                gen=state.gen + state.valid.astype(jnp.int32))
    return toks, state


@functools.partial(jax.jit, donate_argnums=(0,))
def _insert_rows(shard, rows_TL, index_2T):
    """Write rows [T, W] into shard [1, NB, bs, W] of one rank's pool (on that rank's device)
    at (block, offset) = index_2T[:, t]; the shard is donated: updated in place, as every
    pool write (:func:`pdjax.model.cache.scatter_rows`: rounded to the pool's dtype, a narrow
    float selected in, one pass)."""
    return scatter_rows(shard, (0, index_2T[0], index_2T[1]), rows_TL)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _set_slot(block_tables, lengths, state, row, ints, floats):
    """Slot ``ints[0]`` gets block-table ``row``, length ``ints[1]`` and state (last token,
    seed, gen, valid, draft) = ints[2:7], (temperature, top_p) = floats: one small donated update."""
    slot = ints[0]
    values = (ints[2], floats[0], floats[1], ints[3], ints[4], ints[5] != 0, ints[6])
    state = SlotState(*(a.at[slot].set(v.astype(a.dtype)) for a, v in zip(state.fields(), values)))
    return block_tables.at[slot].set(row), lengths.at[slot].set(ints[1]), state


class DecodePool:
    """``speculative="mtp"``: every step verifies each slot's MTP draft and drafts the next
    (:mod:`pdjax.disagg.spec_decode`); the cache then holds the MTP layer's rows after the main
    model's layers (one more layer each request's handoff fills), and a step emits one or two
    tokens per slot. ``spec_counts``: [drafts verified, accepted] since the pool was built."""

    def __init__(self, params, cfg: ModelConfig, devices, mesh_axes: dict, *, slots: int,
                 block_size: int, max_context: int, num_blocks: int | None = None, min_view_tokens: int = 256,
                 speculative: str | None = None):
        if not isinstance(min_view_tokens, int) or min_view_tokens < 1:
            raise ValueError(f"min_view_tokens must be a positive integer, got {min_view_tokens!r}")
        self.cfg = cfg
        self.speculative = speculative
        self.cache_layers = cfg.num_hidden_layers + (speculative is not None)
        self.spec_counts = np.zeros(2, np.int64)
        self.min_view_tokens = min_view_tokens
        self.mesh = make_mesh(mesh_axes, devices)
        self.axes = tuple(self.mesh.axis_names)
        self.ranks = math.prod(self.mesh.shape.values())
        if slots % self.ranks:
            raise ValueError(f"max_decode_slots={slots} must divide over the {self.ranks} decode DP ranks")
        self.slots, self.block_size = slots, block_size
        self.blocks_per_slot = -(-max_context // block_size)
        num_blocks = num_blocks or (slots // self.ranks) * self.blocks_per_slot + 1
        self.ep = ExpertParallel(self.mesh) if "expert" in self.axes else None
        self.params = shard_params(params, cfg, self.mesh)
        self.cache = init_paged_cache(cfg, slots=slots, num_blocks=num_blocks, block_size=block_size,
                                      blocks_per_slot=self.blocks_per_slot, dtype=cfg.kv_cache_dtype,
                                      mesh=self.mesh, axes=self.axes, layers=self.cache_layers)
        self.batch_sharding = NamedSharding(self.mesh, P(self.axes if len(self.axes) > 1 else self.axes[0]))
        self.alloc = BlockAllocator(self.ranks, num_blocks, block_size)
        self.rank_devices = list(self.mesh.devices.flat)      # rank r's pool shard lives here
        self.slot_req: list[Reservation | None] = [None] * slots
        self.kv_len = np.zeros(slots, np.int64)               # host mirror: balancing, view buckets
        self.state = SlotState.empty(slots, self.batch_sharding)
        self.pending: list[Reservation] = []             # reserved, KV still arriving

    # ---- handoff ------------------------------------------------------------------------
    def rank_load(self, rank: int) -> tuple[int, int]:
        per = self.slots // self.ranks
        s = slice(rank * per, (rank + 1) * per)
        running = sum(r is not None for r in self.slot_req[s])
        return running, int(self.kv_len[s].sum())

    def reserve(self, req: Request, long_threshold: int = 1024) -> Reservation | None:
        """Pick a rank (short requests: fewest running; long: least total KV) with a free slot
        and enough blocks, and pre-allocate them. None = the pool is full (back-pressure)."""
        need = self.alloc.blocks_for(len(req.prompt) + req.max_new_tokens)
        per = self.slots // self.ranks
        reserved = [sum(1 for r in self.pending if r.rank == k) for k in range(self.ranks)]
        candidates = []
        for k in range(self.ranks):
            running, kv = self.rank_load(k)
            if running + reserved[k] < per and self.alloc.available(k) >= need:
                key = (kv, running) if len(req.prompt) >= long_threshold else (running + reserved[k], kv)
                candidates.append((key, k))
        if not candidates:
            return None
        rank = min(candidates)[1]
        res = Reservation(req, rank, self.alloc.allocate(rank, need))
        self.pending.append(res)
        return res

    def target_device(self, res: Reservation):
        return self.rank_devices[res.rank]

    def receive_layer(self, res: Reservation, layer: int, rows_TL, start: int = 0) -> None:
        """Write one layer's latent rows [T, C+R] for prompt positions start..start+T-1 (already
        on the owning rank's device) into the request's reserved blocks: a local write into
        that rank's shard of the pool, in place (the shard is donated: a chunk costs its own bytes,
        not the pool's); the other ranks' shards are untouched (no data moves)."""
        self.check_payload(res, layer, rows_TL, start)
        T = rows_TL.shape[0]
        pos = start + np.arange(T)
        index = np.stack([np.asarray(res.blocks, np.int32)[pos // self.block_size],
                          (pos % self.block_size).astype(np.int32)])
        pool = self.cache.pools[layer]
        shards = {s.index[0].start or 0: s.data for s in pool.addressable_shards}
        shards[res.rank] = _insert_rows(shards[res.rank], rows_TL,
                                        jax.device_put(index, self.rank_devices[res.rank]))
        pool = jax.make_array_from_single_device_arrays(pool.shape, pool.sharding,
                                                        [shards[r] for r in range(self.ranks)])
        pools = list(self.cache.pools)
        pools[layer] = pool
        self.cache = dataclasses.replace(self.cache, pools=tuple(pools))
        if not res.rows_received:
            res.rows_received = [0] * self.cache_layers
        res.rows_received[layer] += T

    def check_payload(self, res: Reservation, layer, rows_TL, start) -> None:
        """Raise ValueError naming what is wrong with an arrived layer payload before any of
        it is written: the layer index, the rows' type, shape ``[T, C+R]`` (T >= 1, inside the
        prompt from ``start``, within what the layer still lacks), dtype (one the prefill
        produces: the config's param, compute or cache dtype) and device (the reserving rank's)."""
        cfg, who = self.cfg, f"request {res.request.index} layer {layer!r}"
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.cache_layers:
            raise ValueError(f"{who}: no such layer (the pool caches {self.cache_layers} layers)")
        if not isinstance(rows_TL, jax.Array):
            raise ValueError(f"{who}: payload is a {type(rows_TL).__name__}, not a jax.Array")
        W, T, n = cfg.kv_latent_dim, (rows_TL.shape[0] if rows_TL.ndim else 0), len(res.request.prompt)
        if rows_TL.ndim != 2 or rows_TL.shape[1] != W or T < 1:
            raise ValueError(f"{who}: payload of shape {tuple(rows_TL.shape)}, expected [T >= 1, {W}]")
        if not isinstance(start, (int, np.integer)) or start < 0 or start + T > n:
            raise ValueError(f"{who}: rows {start}..{start + T - 1} outside its {n}-token prompt")
        have = res.rows_received[layer] if res.rows_received else 0
        if have + T > n:
            raise ValueError(f"{who}: {T} more rows after {have} of a {n}-token prompt")
        allowed = {cfg.param_dtype, cfg.compute_dtype, cfg.kv_cache_dtype}
        if rows_TL.dtype.name not in allowed:
            raise ValueError(f"{who}: payload dtype {rows_TL.dtype.name}, expected one of {sorted(allowed)}")
        want = self.rank_devices[res.rank]
        if rows_TL.devices() != {want}:
            raise ValueError(f"{who}: payload on {sorted(rows_TL.devices(), key=lambda d: d.id)}, expected on "
                             f"rank {res.rank}'s device {want}")

    def cancel(self, res: Reservation) -> None:
        if res in self.pending:
            self.pending.remove(res)
            self.alloc.release(res.rank, res.blocks)

    def admit(self, res: Reservation, first_token: int) -> int:
        """Join the running batch (all layers arrived). Returns the slot."""
        if not res.complete:
            raise RuntimeError(f"request {res.request.index}: admitted with {res.rows_received} rows per layer "
                               f"of a {len(res.request.prompt)}-token prompt")
        per = self.slots // self.ranks
        slot = next(s for s in range(res.rank * per, (res.rank + 1) * per) if self.slot_req[s] is None)
        row = np.zeros(self.blocks_per_slot, np.int32)
        row[: len(res.blocks)] = res.blocks
        req = res.request
        # the first token (generation index 0) came from the prefill: the first step samples
        # index len(output) (the driver has usually recorded the first token by now)
        gen = max(len(req.output), 1)
        draft = req.mtp_draft if self.speculative else 0
        if draft is None:
            raise RuntimeError(f"request {req.index}: admitted to a speculative pool without its MTP draft")
        self._set_slot(slot, row, len(req.prompt), (int(first_token), req.sampling.seed, gen, 1, int(draft)),
                       (req.sampling.temperature, req.sampling.top_p))
        self.pending.remove(res)
        self.slot_req[slot] = res
        self.kv_len[slot] = len(req.prompt)
        return slot

    def release(self, slot: int) -> None:
        """Free the slot and its request's blocks (between steps)."""
        res = self.slot_req[slot]
        self._set_slot(slot, np.zeros(self.blocks_per_slot, np.int32), 0, (0, 0, 0, 0, 0), (0.0, 1.0))
        self.slot_req[slot] = None
        self.alloc.release(res.rank, res.blocks)
        self.kv_len[slot] = 0

    def _set_slot(self, slot: int, row, length: int, ints: tuple, floats: tuple) -> None:
        bt, lens, self.state = _set_slot(self.cache.block_tables, self.cache.lengths, self.state, row,
                                         np.array((slot, length) + ints, np.int32), np.array(floats, np.float32))
        self.cache = dataclasses.replace(self.cache, block_tables=bt, lengths=lens)

    # ---- decoding -----------------------------------------------------------------------
    @property
    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.slot_req) if r is not None]

    def view_blocks(self) -> int:
        """Blocks per slot the next step gathers: the bucket (:func:`view_bucket`) of the
        longest running slot's length after the step's write (from the host mirror, no sync),
        at least ``min_view_tokens`` (short contexts share one program: fewer compiles, and a
        step reads at least that many positions a slot)."""
        active = self.active
        new = 2 if self.speculative else 1
        need = int(self.kv_len[active].max()) + new if active else new
        return view_bucket(max(need, self.min_view_tokens), self.block_size, self.blocks_per_slot)

    def warm_up(self, sampling=(False, True)) -> int:
        """Compile the step for every view bucket (and each ``sampling`` variant) now, so no
        later step compiles while it is timed: steps run on the pool as it is, which must be
        empty (an empty slot's rows land in the scratch block and its state does not move).
        Returns the number of programs run."""
        if self.active or self.pending:
            raise RuntimeError("warm_up needs an empty decode pool (no running or reserved request)")
        buckets = sorted({view_bucket(max(n * self.block_size, self.min_view_tokens), self.block_size,
                                      self.blocks_per_slot) for n in range(1, self.blocks_per_slot + 1)})
        for b in buckets:
            for s in sampling:
                self.cache = self.cache.with_view(b)
                toks, self.cache, self.state = self._program(s)
        jax.block_until_ready(toks)
        return len(buckets) * len(sampling)

    def _program(self, sampling: bool):
        step = spec_step if self.speculative else _step
        return step(self.params, self.cfg, self.cache, self.state, self.ep, sampling)

    def step(self) -> dict:
        """One decode step over all slots; returns {slot: new token} for the active ones
        ({slot: (tokens,)}, one or two, with ``speculative``).

        Everything per slot is already on the devices (:class:`SlotState`); the attention reads
        only the first :meth:`view_blocks` blocks of each slot; a batch of greedy requests
        skips the sampling (both static choices, made from host state). The sampled tokens are
        the step's one device-to-host transfer."""
        active = self.active
        if not active:
            return {}
        self.cache = self.cache.with_view(self.view_blocks())
        sampling = any(self.slot_req[s].request.sampling.temperature > 0 for s in active)
        toks, self.cache, self.state = self._program(sampling)
        toks = jax.device_get(toks)
        if not self.speculative:
            self.kv_len[active] += 1
            return {s: int(toks[s]) for s in active}
        keep = toks[active, 2]
        self.kv_len[active] += keep
        self.spec_counts += (len(active), int(np.sum(keep == 2)))
        return {s: tuple(int(t) for t in toks[s, :toks[s, 2]]) for s in active}
