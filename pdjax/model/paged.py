"""A paged latent KV cache: fixed-size blocks of cached rows and a block table per request.

Per layer, a pool ``[R, num_blocks, block_size, C+R]`` of blocks, where R is the number of
DP attention ranks (1 on a single device): each rank owns its own pool and serves its own
slots (slot s lives on rank s // (slots / R)). A request's block table lists the block ids
(local to its rank) holding its positions 0, block_size, 2*block_size, ... Block 0 of every
rank is a scratch block: empty slots point at it, so their writes land nowhere that matters.

``PagedLayer`` is what the model's attention sees in place of a contiguous ``[B,S,C+R]``
layer cache: ``write_and_view`` writes the new rows at each slot's positions (in place when
the pool is donated) and returns a contiguous view ``[slots, view_blocks * block_size, C+R]``
of the first ``view_blocks`` blocks of every slot's table (a gather: each slot reads only its
own blocks). ``PagedCache.view_blocks`` is static: the driver sets it per step to a bucket
of the longest slot's length (:func:`view_bucket`; None = every block of the table), so a
step reads, and its time grows with, the KV the batch really holds, not the pool's
capacity; positions past each slot's length are masked by the attention as before. With a
mesh, both run inside ``jax.shard_map`` so every rank touches only its local pool.

The host side, :class:`BlockAllocator`, hands out and frees blocks per rank.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pdjax.arguments import check_int
from pdjax.model_config import ModelConfig, dtype_name
from pdjax.model.cache import scatter_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayer:
    """One layer's pool and the slots' block tables, as the attention reads them."""

    pool: jax.Array            # [R, num_blocks, block_size, C+R]
    block_tables: jax.Array    # [slots, blocks_per_slot] int32, block ids local to the slot's rank
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    axes: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    view_blocks: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def num_view_blocks(self) -> int:
        """Blocks per slot the view gathers (all of the table when ``view_blocks`` is None)."""
        return self.block_tables.shape[1] if self.view_blocks is None else self.view_blocks

    @property
    def shape(self):           # (slots, view length in tokens, width): what attention masks over
        return (self.block_tables.shape[0], self.num_view_blocks * self.pool.shape[2], self.pool.shape[3])

    @property
    def dtype(self):
        return self.pool.dtype

    def write_and_view(self, new_BTL, start_B):
        """Write rows new_BTL [slots, T, W] at positions start_B + t; return (layer, view), the
        view [slots, num_view_blocks * block_size, W] (the caller keeps every written position
        inside it)."""
        nb = self.num_view_blocks

        def local(pool, tables, new, start):
            pool = _write(pool[0], tables, new, start)[None]
            return pool, _view(pool[0], tables[:, :nb])
        if self.mesh is None:
            pool, view = local(self.pool, self.block_tables, new_BTL, start_B)
        else:
            spec = P(self.axes if len(self.axes) > 1 else self.axes[0])
            pool, view = jax.shard_map(local, mesh=self.mesh, in_specs=(spec,) * 4, out_specs=(spec, spec),
                                       check_vma=False)(self.pool, self.block_tables, new_BTL, start_B)
        return dataclasses.replace(self, pool=pool), view


def _write(pool, tables, new_BTL, start_B):
    """pool [NB, bs, W]; tables [b, MB]; new [b, T, W] written at positions start..start+T-1."""
    bs = pool.shape[1]
    pos = start_B[:, None] + jnp.arange(new_BTL.shape[1])[None, :]             # [b, T]
    blocks = jnp.take_along_axis(tables, pos // bs, axis=1, mode="clip")       # [b, T]
    return scatter_rows(pool, (blocks, pos % bs), new_BTL)


def _view(pool, tables):
    """The blocks of ``tables [b, nb]`` gathered into rows [b, nb * bs, W]."""
    b, MB = tables.shape
    return pool[tables].reshape(b, MB * pool.shape[1], pool.shape[2])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedCache:
    """Pools (one per layer), the slots' block tables and lengths; the model reads it through
    ``layers()`` (one :class:`PagedLayer` per layer) like a contiguous
    :class:`~pdjax.model.cache.KVCache`."""

    pools: tuple               # per layer [R, num_blocks, block_size, C+R]
    block_tables: jax.Array    # [slots, blocks_per_slot] int32
    lengths: jax.Array         # [slots] int32 (0 = empty slot)
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    axes: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    view_blocks: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def block_size(self) -> int:
        return self.pools[0].shape[2]

    @property
    def max_len(self) -> int:
        return self.block_tables.shape[1] * self.block_size

    @property
    def batch(self) -> int:
        return self.block_tables.shape[0]

    @property
    def dtype(self):
        return self.pools[0].dtype

    def nbytes_per_token(self) -> int:
        return sum(p.shape[3] * p.dtype.itemsize for p in self.pools)

    def layers(self) -> tuple:
        return tuple(PagedLayer(p, self.block_tables, self.mesh, self.axes, self.view_blocks) for p in self.pools)

    def with_layers(self, layers, lengths) -> "PagedCache":
        return dataclasses.replace(self, pools=tuple(l.pool for l in layers), lengths=lengths)

    def with_view(self, view_blocks: int | None) -> "PagedCache":
        """The same cache, its attention reading the first ``view_blocks`` blocks of each slot
        (None: all). The caller keeps every slot's length + new rows within them."""
        if view_blocks is not None and not 0 < view_blocks <= self.block_tables.shape[1]:
            raise ValueError(f"view_blocks must be in [1, {self.block_tables.shape[1]}] or None, got {view_blocks!r}")
        return dataclasses.replace(self, view_blocks=view_blocks)


def view_bucket(tokens: int, block_size: int, blocks_per_slot: int) -> int:
    """Blocks a step must gather to cover ``tokens`` positions, rounded up to a bucket (1, 2,
    3, 4, 6, 8, 12, 16, ...: powers of two and 1.5 times them, so a step reads at most 1.5x
    the blocks it needs and compiles once per bucket), capped at ``blocks_per_slot``."""
    need = max(1, -(-tokens // block_size))
    b = 1 << (need - 1).bit_length()                     # next power of two >= need
    if need <= 3 * b // 4:
        b = 3 * b // 4
    return min(b, blocks_per_slot)


def init_paged_cache(cfg: ModelConfig, *, slots: int, num_blocks: int, block_size: int,
                     blocks_per_slot: int, dtype=None, mesh: Mesh | None = None,
                     axes: tuple = (), layers: int | None = None) -> PagedCache:
    """An empty paged cache: ``num_blocks`` blocks per rank (block 0 is scratch), ``slots``
    decode slots each addressing up to ``blocks_per_slot`` blocks. With a mesh, the pools and
    slots are split over ``axes`` (the DP attention ranks). ``dtype``: default
    ``cfg.kv_cache_dtype``. ``layers``: pools to hold (default ``cfg.num_hidden_layers``; the
    MTP layer of speculative decoding adds one, addressed by the same block tables)."""
    dtype = cfg.kv_cache_dtype if dtype is None else dtype_name(dtype, "init_paged_cache dtype")
    layers = cfg.num_hidden_layers if layers is None else layers
    for name, v in (("slots", slots), ("num_blocks", num_blocks), ("block_size", block_size),
                    ("blocks_per_slot", blocks_per_slot), ("layers", layers)):
        check_int(name, v)
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
    ranks = math.prod(mesh.shape[a] for a in axes) if mesh is not None else 1
    if slots % ranks:
        raise ValueError(f"slots={slots} must divide over {ranks} DP ranks")
    if blocks_per_slot * block_size > cfg.max_position_embeddings:
        raise ValueError(f"blocks_per_slot*block_size={blocks_per_slot * block_size} exceeds "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    pools = tuple(jnp.zeros((ranks, num_blocks, block_size, cfg.kv_latent_dim), dtype)
                  for _ in range(layers))
    cache = PagedCache(pools, jnp.zeros((slots, blocks_per_slot), jnp.int32),
                       jnp.zeros((slots,), jnp.int32), mesh, tuple(axes))
    if mesh is not None:
        cache = jax.device_put(cache, jax.sharding.NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0])))
    return cache


class BlockAllocator:
    """Free lists of blocks per DP rank (block 0 of each rank is never handed out)."""

    def __init__(self, ranks: int, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = [list(range(num_blocks - 1, 0, -1)) for _ in range(ranks)]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def available(self, rank: int) -> int:
        return len(self.free[rank])

    def allocate(self, rank: int, n: int) -> list[int] | None:
        """n blocks on ``rank``, or None (nothing taken) when fewer are free."""
        if n > len(self.free[rank]):
            return None
        return [self.free[rank].pop() for _ in range(n)]

    def release(self, rank: int, blocks) -> None:
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} is not a releasable block of rank {rank}")
            self.free[rank].append(b)
