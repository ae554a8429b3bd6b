"""Cross-request prefix KV store for the PD engine (cross-request prefix reuse through
a shared store, as opposed to the in-request P->D KV handoff).

Latent KV in full blocks of ``block_size`` tokens, keyed by the hash chain over token ids
(:func:`pdjax.prefix_index.token_chain_hashes`). A block holds every layer's latent
rows: an array ``[L, block_size, W]`` with ``W = kv_lora_rank + qk_rope_head_dim``, in the
params dtype. Three tiers, each an LRU index with TTL (:class:`PrefixCache`) over its own
capacity in blocks:

- ``device``: jax arrays on one device (``device=``, default ``jax.devices()[0]``);
- ``host``: numpy arrays;
- ``disk``: a TensorStore zarr3 array ``[disk_blocks + 1, L, block_size, W]`` in a private
  directory under ``disk_dir``, one chunk (one file) per block slot, uncompressed; a block
  is written to a free slot and its slot freed when it leaves (one spare slot lets a block
  be written before the LRU block it displaces is demoted out).

New blocks enter the first tier with room; a block evicted from a tier is demoted to the
next one (device -> host -> disk) keeping its expiry, and dropped after the last one. A
block lives in exactly one tier. Retention classes give each block a TTL from its last
write (``{"chat": 7 days, "agent": 3 days}`` by default); an expired block is a miss and
is dropped. Every block carries the CRC-32 of its bytes, checked when it is loaded.

The engine's path: :meth:`PrefixStore.lookup` (metadata only, before any data moves) gives
the cached prefix length; :meth:`PrefixStore.load` verifies the hit blocks and streams
them layer by layer to the prefill device, the copy of layer l+1 issued before layer l is
handed out; :meth:`PrefixStore.insert` stores a finished prefill's full blocks.

Costs worth knowing: checking a device-tier block reads it back to host (free on CPU, a
device->host copy on an accelerator); a disk hit is read whole (all layers) when
:meth:`PrefixStore.load` is called, the host->device copies then run one layer ahead. The index is in
memory: the disk tier does not survive the store (its directory is removed with it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
import zlib
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from pdjax.model_config import ModelConfig
from pdjax.prefix_index import PrefixCache, check_block_size, token_chain_hashes

TIERS = ("device", "host", "disk")
DAY = 86400.0
_device_put = jax.device_put        # module-level so a test can watch the copies being issued


class CorruptBlockError(ValueError):
    """A stored block failed its checksum; it has been evicted, so recomputing works."""

    def __init__(self, block_hash: int, tier: str):
        super().__init__(f"prefix block {block_hash:032x} failed its checksum in the {tier} tier")
        self.block_hash, self.tier = block_hash, tier


class MissingBlockError(LookupError):
    """A block asked for by :meth:`PrefixStore.load` is not stored (evicted or expired since
    the lookup): the caller recomputes it."""

    def __init__(self, block_hash: int, index: int):
        super().__init__(f"prefix block {index} ({block_hash:032x}) is not in the store")
        self.block_hash, self.index = block_hash, index


def _checksum(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block).view(np.uint8))


class PrefixStore:
    """Tiered, checksummed store of latent-KV prefix blocks; see the module docstring.

    ``cfg``: the model (layers L, width W = ``cfg.kv_latent_dim``); ``block_size``: tokens
    per block; ``device_blocks`` / ``host_blocks`` / ``disk_blocks``: tier capacities in
    blocks (0 disables a tier); ``disk_dir``: where the disk tier's directory is made
    (required when ``disk_blocks`` > 0); ``retention``: ``{class: ttl_seconds}``;
    ``clock``: seconds, injectable for tests; ``dtype``: the dtype of the rows (the latent cache's);
    ``device``: where device-tier blocks live; ``layers``: the layers a block holds (default
    L; a speculative engine's L + 1, the MTP layer's rows last). Thread-safe (one lock
    around the index).
    """

    def __init__(self, cfg: ModelConfig, block_size: int, *, device_blocks: int, host_blocks: int,
                 disk_dir: Optional[str] = None, disk_blocks: int = 0,
                 retention: Optional[dict] = None, clock: Callable[[], float] = time.time,
                 dtype=jnp.float32, device=None, layers: Optional[int] = None):
        check_block_size(block_size)
        if retention is None:
            retention = {"chat": 7 * DAY, "agent": 3 * DAY}
        if not retention:
            raise ValueError("retention must name at least one class, got {}")
        caps = {"device": device_blocks, "host": host_blocks, "disk": disk_blocks}
        for tier, cap in caps.items():
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ValueError(f"{tier}_blocks must be an integer >= 0, got {cap!r}")
        if disk_blocks and disk_dir is None:
            raise ValueError(f"disk_blocks={disk_blocks} needs a disk_dir")
        self.cfg, self.block_size = cfg, int(block_size)
        self.num_layers = cfg.num_hidden_layers if layers is None else layers
        self.width = cfg.kv_latent_dim
        self.dtype = np.dtype(jnp.dtype(dtype))      # "bfloat16" etc. by name too
        self.device = device if device is not None else jax.devices()[0]
        self.clock = clock
        self.retention = dict(retention)
        self.block_bytes = self.num_layers * self.block_size * self.width * self.dtype.itemsize
        self._index = {t: PrefixCache(caps[t], self.block_size, self.retention,
                                      on_evict=lambda h, exp, t=t: self._demote(h, exp, t),
                                      on_expire=lambda h, t=t: self._discard(h, t, "expired"))
                       for t in TIERS}
        self._data: dict = {t: {} for t in TIERS}      # disk: hash -> slot of the zarr array
        self._crc: dict[int, int] = {}
        self._lock = threading.RLock()
        self.disk_path = None
        if disk_blocks:
            os.makedirs(disk_dir, exist_ok=True)
            self.disk_path = tempfile.mkdtemp(prefix="pdjax-prefix-", dir=disk_dir)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.disk_path, True)
            shape = [disk_blocks + 1, self.num_layers, self.block_size, self.width]
            self._disk = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                                "path": os.path.join(self.disk_path, "blocks.zarr")},
                                  "context": {"cache_pool": {"total_bytes_limit": 0}},
                                  "store_data_equal_to_fill_value": True},      # every block a file
                                 create=True, dtype=ts.dtype(self.dtype.name), shape=shape,
                                 chunk_layout=ts.ChunkLayout(write_chunk_shape=[1] + shape[1:])).result()
            self._free_slots = list(range(disk_blocks, -1, -1))
        self.stats = {"lookups": 0, "hit_blocks": 0, "miss_blocks": 0, "hit_tokens": 0,
                      "miss_tokens": 0, "inserted_blocks": 0, "loads": 0,
                      "blocks_loaded": dict.fromkeys(TIERS, 0),
                      "bytes_loaded": dict.fromkeys(TIERS, 0),
                      "evictions": dict.fromkeys(TIERS, 0),   # demoted out of (disk: dropped)
                      "expired_blocks": 0, "corrupt_blocks": 0}

    # ---- metadata ------------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chain keys of the full blocks of ``tokens``."""
        return token_chain_hashes(tokens, self.block_size)

    def tier_of(self, block_hash: int) -> Optional[str]:
        """The tier holding ``block_hash`` now (None when absent or expired)."""
        with self._lock:
            return self._where(block_hash, self.clock())

    def __len__(self) -> int:
        return sum(len(ix) for ix in self._index.values())

    def lookup(self, tokens: Sequence[int], peek: bool = False) -> int:
        """Number of leading tokens of ``tokens`` whose KV is stored: a multiple of
        ``block_size``, never covering the last token (a prefill computes at least one).
        Metadata only: no block is read; the hit blocks become most recently used.
        ``peek``: leave LRU order and the statistics alone (e.g. a scheduler's estimate)."""
        with self._lock:
            now = self.clock()
            usable = max(len(tokens) - 1, 0) // self.block_size
            hs = self.hashes(list(tokens)[:usable * self.block_size])
            n = 0
            for h in hs:
                tier = self._where(h, now)
                if tier is None:
                    break
                n += 1
            if peek:
                return n * self.block_size
            self._touch(hs[:n])
            s = self.stats
            s["lookups"] += 1
            s["hit_blocks"] += n
            s["miss_blocks"] += usable - n
            s["hit_tokens"] += n * self.block_size
            s["miss_tokens"] += len(tokens) - n * self.block_size
            return n * self.block_size

    # ---- insert --------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], layer_rows: Sequence, retention: str = "chat") -> int:
        """Store every full block of ``tokens`` not yet stored; returns how many were added.

        ``layer_rows``: one array per layer, ``[T, W]`` (jax or numpy, the store's dtype),
        the latent rows of the first T >= (full blocks x block_size) tokens. Blocks already
        stored get their expiry extended and become most recently used."""
        if retention not in self.retention:
            raise ValueError(f"unknown retention class {retention!r}; known: {sorted(self.retention)}")
        hs = self.hashes(tokens)
        need = len(hs) * self.block_size
        if len(layer_rows) != self.num_layers:
            raise ValueError(f"layer_rows must have one array per layer ({self.num_layers}), "
                             f"got {len(layer_rows)}")
        for l, rows in enumerate(layer_rows):
            shape = tuple(rows.shape)
            if len(shape) != 2 or shape[1] != self.width:
                raise ValueError(f"layer_rows[{l}] must be [T, {self.width}] "
                                 f"(width kv_lora_rank + qk_rope_head_dim), got shape {shape}")
            if shape[0] < need:
                raise ValueError(f"layer_rows[{l}] has {shape[0]} rows, fewer than the "
                                 f"{need} tokens of the prompt's full blocks")
            if np.dtype(rows.dtype) != self.dtype:
                raise ValueError(f"layer_rows[{l}] dtype {np.dtype(rows.dtype)} is not the "
                                 f"store's dtype {self.dtype}")
        with self._lock:
            now = self.clock()
            present = [self._where(h, now) for h in hs]
            new = [i for i, t in enumerate(present) if t is None]
            if new:                                 # one host copy of the rows that are new
                lo, hi = new[0] * self.block_size, (new[-1] + 1) * self.block_size
                host = np.stack([np.asarray(rows[lo:hi]) for rows in layer_rows])   # [L, hi-lo, W]
            for i in reversed(range(len(hs))):      # tail first: the head ends most recent
                h, tier = hs[i], present[i]
                if tier is not None:                # refresh where it lives now (an insert
                    tier = self._where(h, now)      # below may have demoted it)
                    if tier is not None:
                        self._index[tier].insert([h], now, retention)
                    continue
                a = i * self.block_size - lo
                block = np.ascontiguousarray(host[:, a:a + self.block_size])
                self._crc[h] = _checksum(block)
                self._put(h, block, None, now, retention, TIERS)
                self.stats["inserted_blocks"] += 1
            return len(new)

    # ---- load ----------------------------------------------------------------------------
    def load(self, tokens: Sequence[int], num_tokens: int, device) -> Iterator[tuple[int, jax.Array]]:
        """Stream the stored KV of the first ``num_tokens`` tokens (a multiple of
        ``block_size``, at most the prompt's full blocks) to ``device`` (a jax Device or
        Sharding): yields ``(layer, rows [num_tokens, W])`` for layer 0..L-1, the
        asynchronous copy of layer l+1 issued before layer l is yielded.

        Every block is found and checksum-verified before this returns: a block gone since
        the lookup raises :class:`MissingBlockError`, a block whose bytes changed raises
        :class:`CorruptBlockError` after it is evicted (a retry recomputes it)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
                or num_tokens < 0 or num_tokens % self.block_size:
            raise ValueError(f"num_tokens must be a multiple of block_size={self.block_size} "
                             f"and >= 0, got {num_tokens!r}")
        nb = num_tokens // self.block_size
        hs = self.hashes(list(tokens)[:num_tokens])
        if len(hs) < nb:
            raise ValueError(f"num_tokens={num_tokens} exceeds the prompt's {len(tokens)} tokens")
        with self._lock:
            now = self.clock()
            sources = []
            for i, h in enumerate(hs):
                tier = self._where(h, now)
                if tier is None:
                    raise MissingBlockError(h, i)
                block = self._read(h, tier)
                if block is None or _checksum(np.asarray(block)) != self._crc.get(h):
                    self._discard(h, tier, "corrupt")
                    raise CorruptBlockError(h, tier)
                sources.append(block)
                self.stats["blocks_loaded"][tier] += 1
                self.stats["bytes_loaded"][tier] += self.block_bytes
            self._touch(hs)
            self.stats["loads"] += 1
        return self._stream(sources, device)

    def _stream(self, sources: list, device) -> Iterator[tuple[int, jax.Array]]:
        def issue(l):
            if not sources:
                return _device_put(np.zeros((0, self.width), self.dtype), device)
            pieces, run = [], []
            for blk in sources:
                if isinstance(blk, np.ndarray):     # host/disk: batch consecutive blocks
                    run.append(blk[l])
                    continue
                if run:
                    pieces.append(_device_put(np.concatenate(run), device))
                    run = []
                pieces.append(_device_put(blk[l], device))
            if run:
                pieces.append(_device_put(np.concatenate(run), device))
            return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)

        nxt = issue(0)
        for l in range(self.num_layers):
            cur = nxt
            if l + 1 < self.num_layers:
                nxt = issue(l + 1)                  # in flight while layer l is consumed
            yield l, cur

    # ---- tiers ---------------------------------------------------------------------------
    def _where(self, h: int, now: float) -> Optional[str]:
        for tier in TIERS:
            if self._index[tier].alive(h, now):
                return tier
        return None

    def _touch(self, hs: Sequence[int]) -> None:
        for ix in self._index.values():
            ix.touch(hs)

    def _put(self, h: int, block: np.ndarray, expiry, now: float, retention: str, tiers) -> None:
        """Place a host block in the first of ``tiers`` with room (dropped when none)."""
        for tier in tiers:
            ix = self._index[tier]
            if not ix.capacity:
                continue
            if tier == "device":
                self._data[tier][h] = jax.device_put(block, self.device)
            elif tier == "host":
                self._data[tier][h] = block
            else:
                self._data[tier][h] = self._write_disk(block)
            ix.insert([h], now, retention, expiry=expiry)   # may demote the LRU block
            return
        self._crc.pop(h, None)

    def _demote(self, h: int, expiry: float, tier: str) -> None:
        """``on_evict`` of ``tier``'s index: move the block one tier down (or drop it)."""
        self.stats["evictions"][tier] += 1
        data = self._data[tier].pop(h)
        now = self.clock()
        rest = TIERS[TIERS.index(tier) + 1:]
        if expiry <= now or not any(self._index[t].capacity for t in rest):
            self._delete(data, tier)
            self._crc.pop(h, None)
            return
        block = self._read_data(data, tier)
        self._delete(data, tier)
        if block is None:                            # unreadable file: nothing to keep
            self._crc.pop(h, None)
            return
        self._put(h, block, expiry, now, "", rest)

    def _discard(self, h: int, tier: str, why: str) -> None:
        """Drop a block from ``tier`` (expired or corrupt)."""
        self._index[tier].remove(h)
        data = self._data[tier].pop(h, None)
        if data is not None:
            self._delete(data, tier)
        self._crc.pop(h, None)
        self.stats["expired_blocks" if why == "expired" else "corrupt_blocks"] += 1

    def _read(self, h: int, tier: str):
        """A stored block as it will be streamed: a jax array (device tier) or numpy."""
        data = self._data[tier].get(h)
        if data is None:
            return None
        return data if tier == "device" else self._read_data(data, tier)

    def _read_data(self, data, tier: str) -> Optional[np.ndarray]:
        if tier != "disk":
            return np.asarray(data)
        try:
            return np.asarray(self._disk[data].read().result(), self.dtype)
        except (OSError, ValueError):
            return None

    def _write_disk(self, block: np.ndarray) -> int:
        slot = self._free_slots.pop()
        try:
            self._disk[slot].write(np.ascontiguousarray(block, self.dtype)).result()
        except BaseException:
            self._free_slots.append(slot)
            raise
        return slot

    def _delete(self, data, tier: str) -> None:
        if tier == "disk":
            self._free_slots.append(data)

    def _chunk_file(self, slot: int) -> str:
        """The file holding disk slot ``slot`` (zarr3 default chunk keys: c/slot/0/0/0)."""
        return os.path.join(self.disk_path, "blocks.zarr", "c", str(slot), "0", "0", "0")

    def close(self) -> None:
        """Remove the disk tier's directory (also done when the store is collected)."""
        if self.disk_path is not None:
            self._finalizer()
