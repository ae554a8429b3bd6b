"""Prefix-cache index: the hash chain over token blocks and a capacity-limited LRU with TTL.

Metadata only, no KV data: the serving simulator (:mod:`pdjax.sim.prefix_cache`) uses it as
its whole cache, the real store (:mod:`pdjax.disagg.prefix_store`) uses one per storage tier.

Block i of a prompt is keyed by ``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = 0``,
so equal keys mean equal *prefixes*, not just equal blocks. Only full blocks are keyed. For
token ids ``H`` is a 128-bit BLAKE2b digest over the previous key and the block's ids as
little-endian int64 (:func:`token_chain_hashes`): the same in every process and Python
version, and collision resistant, which a store that hands KV of one prompt to another
must be. Keys are Python ints.

:class:`PrefixCache` has a capacity in blocks and evicts least-recently-used blocks. A chain
is touched from its tail to its head, so a prefix block is always more recent than the
blocks that extend it and eviction removes chain tails first (a chain never loses its head
while keeping its tail). Each block belongs to a retention class with a TTL counted from its
last write (e.g. 3 days for agent traffic, 7 days for chat); an expired block is a miss and
is dropped. Optional callbacks report capacity evictions (``on_evict(hash, expiry)``: the
store demotes the block to the next tier) and expiries (``on_expire(hash)``).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np

from pdjax.arguments import check_int

_PERSON = b"pdjax-prefix"       # BLAKE2b personalisation: keys of this chain only


def check_block_size(block_size) -> None:
    check_int("block_size", block_size)


def token_chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chain keys (128-bit ints) of the full blocks of a token-id sequence: one per block of
    ``block_size`` tokens, a trailing partial block has none. Ids must fit in int64."""
    check_block_size(block_size)
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    n = len(ids) // block_size
    raw = ids[:n * block_size].astype("<i8").tobytes()
    step = 8 * block_size
    out, prev = [], bytes(16)
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step], digest_size=16,
                               person=_PERSON).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


class PrefixCache:
    """Capacity-limited LRU index of chain-hashed blocks with per-class TTL (metadata only).

    ``capacity_blocks``: how many blocks fit; ``block_size``: tokens per block;
    ``retention``: ``{class: ttl_seconds}`` (a missing class gets ``default_ttl``,
    infinite unless given). Times are seconds on the caller's clock. Counters: ``lookups``,
    ``hit_blocks``, ``looked_blocks``, ``inserted``, ``evicted``, ``expired``.
    """

    def __init__(self, capacity_blocks: int, block_size: int = 64,
                 retention: Optional[dict] = None, default_ttl: float = math.inf, *,
                 on_evict: Optional[Callable[[int, float], None]] = None,
                 on_expire: Optional[Callable[[int], None]] = None):
        check_int("capacity_blocks", capacity_blocks, 0)
        check_block_size(block_size)
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.retention = dict(retention or {})
        for cls, ttl in list(self.retention.items()) + [("default_ttl", default_ttl)]:
            if not (isinstance(ttl, (int, float)) and ttl > 0):
                raise ValueError(f"retention TTL of class {cls!r} must be > 0 seconds, got {ttl!r}")
        self.default_ttl = default_ttl
        self.on_evict, self.on_expire = on_evict, on_expire
        self._blocks: OrderedDict[int, float] = OrderedDict()   # hash -> expiry time
        self.lookups = self.hit_blocks = self.looked_blocks = 0
        self.inserted = self.evicted = self.expired = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def ttl(self, retention_class: str) -> float:
        return self.retention.get(retention_class, self.default_ttl)

    def expiry(self, h: int) -> Optional[float]:
        """Expiry time of block ``h`` (None when absent); does not check it."""
        return self._blocks.get(h)

    def alive(self, h: int, now: float) -> bool:
        """Whether ``h`` is present and unexpired at ``now``; an expired block is dropped."""
        exp = self._blocks.get(h)
        if exp is None:
            return False
        if exp <= now:
            del self._blocks[h]
            self.expired += 1
            if self.on_expire is not None:
                self.on_expire(h)
            return False
        return True


    def peek(self, hashes: Sequence[int], now: float) -> int:
        """Cached prefix length in blocks, without touching LRU order or counters
        (expired blocks met on the way are still dropped)."""
        n = 0
        for h in hashes:
            if not self.alive(h, now):
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        """Make the present blocks among ``hashes`` most recently used, the first one most
        recent (a chain's head outlives its tail)."""
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def lookup(self, hashes: Sequence[int], now: float) -> int:
        """Cached prefix length in blocks; the hit blocks become most recently used."""
        n = self.peek(hashes, now)
        self.lookups += 1
        self.looked_blocks += len(hashes)
        self.hit_blocks += n
        for h in reversed(hashes[:n]):
            self._blocks.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[int], now: float, retention_class: str = "default", *,
               expiry: Optional[float] = None) -> int:
        """Store a chain (at most ``capacity`` leading blocks); returns blocks newly added.
        Written blocks get expiry ``now + ttl(class)``, or ``expiry`` when given (a block
        demoted from another tier keeps its own); a rewrite extends it, never shortens it.
        Blocks pushed out by the capacity go to ``on_evict`` (least recent first)."""
        if not self.capacity or not hashes:
            return 0
        chain = hashes[:self.capacity]
        if expiry is None:
            expiry = now + self.ttl(retention_class)
        blocks = self._blocks
        get, to_end = blocks.get, blocks.move_to_end
        added = 0
        for h in reversed(chain):
            old = get(h)
            if old is None:                 # new keys enter most recent, head last
                blocks[h] = expiry
                added += 1
            else:                           # a rewrite extends the expiry and refreshes
                if old < expiry:
                    blocks[h] = expiry
                to_end(h)
        self.inserted += added
        excess = len(blocks) - self.capacity
        if excess > 0:
            pop = blocks.popitem
            self.evicted += excess
            if self.on_evict is None:
                for _ in range(excess):
                    pop(last=False)
            else:
                for _ in range(excess):
                    self.on_evict(*pop(last=False))
        return added

    def remove(self, h: int) -> bool:
        """Drop block ``h`` (no callback); True when it was present."""
        return self._blocks.pop(h, None) is not None

    def hit_rate(self) -> float:
        """Fraction of looked-up blocks that hit."""
        return self.hit_blocks / self.looked_blocks if self.looked_blocks else 0.0

    def lru_order(self) -> list[int]:
        """Block hashes from least to most recently used (for tests and inspection)."""
        return list(self._blocks)
