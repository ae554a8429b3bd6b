"""The decode pool: a paged latent cache on its own mesh, continuous batching over a fixed
set of slots, and the receiving end of the KV handoff.

Handoff protocol (decode side): ``reserve`` picks a DP rank and pre-allocates every block
the request will need (prompt + max_new_tokens) before the prefill starts; ``receive_layer``
writes each layer's latent rows into those blocks as they arrive; ``admit`` joins the
request to the running batch once all layers are in; ``release`` frees its blocks when it
finishes. Requests join and leave between steps. One thread drives a pool (the decode
scheduler's driver); prefill workers only read ``target_device``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.config import ModelConfig
from pdjax.disagg.request import Request, sample
from pdjax.model.paged import BlockAllocator, init_paged_cache
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


@functools.partial(jax.jit, static_argnames=("cfg", "moe_impl"), donate_argnames=("cache",))
def _step(params, cfg, tokens, cache, temperature, top_p, seed, gen_step, valid, moe_impl):
    logits, cache = decode_core(params, cfg, tokens, cache, moe_impl, valid)
    return sample(logits, temperature, top_p, seed, gen_step), cache


@jax.jit
def _insert_rows(shard, rows_TL, blocks_T, offsets_T):
    """shard [1, NB, bs, W] of one rank's pool (on that rank's device)."""
    return shard.at[0, blocks_T, offsets_T].set(rows_TL.astype(shard.dtype))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_slot(block_tables, lengths, slot, row, length):
    return block_tables.at[slot].set(row), lengths.at[slot].set(length)


class DecodePool:
    def __init__(self, params, cfg: ModelConfig, devices, mesh_axes: dict, *, slots: int,
                 block_size: int, max_context: int, num_blocks: int | None = None):
        self.cfg = cfg
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
                                      mesh=self.mesh, axes=self.axes)
        self.batch_sharding = NamedSharding(self.mesh, P(self.axes if len(self.axes) > 1 else self.axes[0]))
        self.alloc = BlockAllocator(self.ranks, num_blocks, block_size)
        self.rank_devices = list(self.mesh.devices.flat)      # rank r's pool shard lives here
        self.slot_req: list[Reservation | None] = [None] * slots
        self.kv_len = np.zeros(slots, np.int64)               # host mirror, for balancing
        self.last_token = np.zeros(slots, np.int32)
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
        that rank's shard of the pool; the other ranks' shards are untouched (no data moves)."""
        T = rows_TL.shape[0]
        if start < 0 or start + T > len(res.request.prompt):
            raise ValueError(f"request {res.request.index}: rows {start}..{start + T - 1} outside its "
                             f"{len(res.request.prompt)}-token prompt")
        pos = start + np.arange(T)
        dev = self.rank_devices[res.rank]
        blocks = jax.device_put(np.asarray(res.blocks, np.int32)[pos // self.block_size], dev)
        offsets = jax.device_put((pos % self.block_size).astype(np.int32), dev)
        pool = self.cache.pools[layer]
        shards = {s.index[0].start or 0: s.data for s in pool.addressable_shards}
        shards[res.rank] = _insert_rows(shards[res.rank], rows_TL, blocks, offsets)
        pool = jax.make_array_from_single_device_arrays(pool.shape, pool.sharding,
                                                        [shards[r] for r in range(self.ranks)])
        pools = list(self.cache.pools)
        pools[layer] = pool
        self.cache = dataclasses.replace(self.cache, pools=tuple(pools))
        if not res.rows_received:
            res.rows_received = [0] * self.cfg.num_hidden_layers
        res.rows_received[layer] += T

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
        bt, lens = _set_slot(self.cache.block_tables, self.cache.lengths, slot, jnp.asarray(row),
                             len(res.request.prompt))
        self.cache = dataclasses.replace(self.cache, block_tables=bt, lengths=lens)
        self.pending.remove(res)
        self.slot_req[slot] = res
        self.kv_len[slot] = len(res.request.prompt)
        self.last_token[slot] = first_token
        return slot

    def release(self, slot: int) -> None:
        res = self.slot_req[slot]
        bt, lens = _set_slot(self.cache.block_tables, self.cache.lengths, slot,
                             jnp.zeros(self.blocks_per_slot, jnp.int32), 0)
        self.cache = dataclasses.replace(self.cache, block_tables=bt, lengths=lens)
        self.slot_req[slot] = None
        self.alloc.release(res.rank, res.blocks)
        self.kv_len[slot] = 0

    # ---- decoding -----------------------------------------------------------------------
    @property
    def active(self) -> list[int]:
        return [s for s, r in enumerate(self.slot_req) if r is not None]

    def step(self) -> dict[int, int]:
        """One decode step over all slots; returns {slot: new token} for the active ones."""
        reqs = [r.request if r else None for r in self.slot_req]
        temp = np.array([r.sampling.temperature if r else 0.0 for r in reqs], np.float32)
        top_p = np.array([r.sampling.top_p if r else 1.0 for r in reqs], np.float32)
        seed = np.array([r.sampling.seed if r else 0 for r in reqs], np.int32)
        gen = np.array([len(r.output) if r else 0 for r in reqs], np.int32)
        valid = np.array([r is not None for r in reqs])       # empty slots: padding for the MoE
        place = functools.partial(jax.device_put, device=self.batch_sharding)
        toks, self.cache = _step(self.params, self.cfg, place(self.last_token), self.cache, place(temp),
                                 place(top_p), place(seed), place(gen), place(valid), self.ep)
        toks = np.asarray(toks)
        out = {}
        for s in self.active:
            out[s] = int(toks[s])
            self.last_token[s] = toks[s]
            self.kv_len[s] += 1
        return out
