"""Cross-request prefix cache: KV in fixed-size blocks keyed by a hash chain.

Block i of a prompt is keyed by ``h_i = hash((h_{i-1}, content of block i))`` with
``h_{-1} = 0``, so equal keys mean equal *prefixes*, not just equal blocks. Only full
blocks are cached. A lookup walks the chain until the first miss and returns the number of
cached blocks: metadata only, no data moves (DeepSeek's CHECK step before load
balancing).

The store has a capacity in blocks and evicts least-recently-used blocks. A chain is
touched from its tail to its head, so a prefix block is always more recent than the
blocks that extend it and eviction removes chain tails first (a chain never loses its
head while keeping its tail). Each block belongs to a retention class with a TTL counted
from its last write (e.g. 3 days for agent traffic, 7 days for chat); an expired block
is a miss and is dropped.

Block content comes either from real token ids (:func:`token_chain_hashes`) or from a
segment description (:func:`segment_chain_hashes`, the simulator's symbolic prompts:
``(segment_id, length)`` pairs, equal ids meaning equal tokens). Both hash Python ints and
tuples only, so keys are the same in every process (no string-hash randomisation).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional, Sequence


def token_chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks of a token-id sequence."""
    _check_block(block_size)
    out, h = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(int(t) for t in tokens[i:i + block_size])))
        out.append(h)
    return out


def segment_chain_hashes(segments: Sequence[tuple[int, int]], block_size: int,
                         max_tokens: Optional[int] = None) -> list[int]:
    """Chain hashes of the full blocks of a prompt given as ``(segment_id, length)``
    pairs; a block's content is the tuple of ``(segment_id, start, end)`` pieces it covers.
    Only the first ``max_tokens`` tokens are hashed when given."""
    _check_block(block_size)
    if max_tokens is not None:
        clipped, left = [], max_tokens
        for seg, length in segments:
            if left <= 0:
                break
            clipped.append((seg, min(length, left)))
            left -= length
        segments = clipped
    out: list = []
    extend_chain(None, segments, block_size, out)
    return out


def extend_chain(state, segments: Sequence[tuple[int, int]], block_size: int, out: list):
    """Continue a segment hash chain: ``state`` is what a previous call returned (None to
    start), the hashes of newly completed blocks are appended to ``out``; returns the new
    state ``(h, pieces, fill)`` (the last hash, the pieces and token count of the partial
    block), so a prompt's chain can be extended by its output or by the next turn without
    rehashing."""
    h, pieces, fill = state if state is not None else (0, (), 0)
    pieces = list(pieces)
    append = out.append
    for seg, length in segments:
        off = 0
        if fill:                                   # complete the partial block first
            take = min(length, block_size - fill)
            pieces.append((seg, 0, take))
            off, fill = take, fill + take
            if fill == block_size:
                h = hash((h, tuple(pieces)))
                append(h)
                pieces, fill = [], 0
        full_end = off + (length - off) // block_size * block_size
        for o in range(off, full_end, block_size):  # whole blocks inside the segment
            h = hash((h, ((seg, o, o + block_size),)))
            append(h)
        if full_end < length:
            pieces.append((seg, full_end, length))
            fill = length - full_end
    return h, tuple(pieces), fill


def _check_block(block_size):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


class PrefixCache:
    """Capacity-limited LRU store of chain-hashed KV blocks with per-class TTL.

    ``capacity_blocks``: how many blocks fit; ``block_size``: tokens per block;
    ``retention``: ``{class: ttl_seconds}`` (a missing class gets ``default_ttl``,
    infinite unless given). Counters: ``lookups``, ``hit_blocks``, ``looked_blocks``,
    ``inserted``, ``evicted``, ``expired``.
    """

    def __init__(self, capacity_blocks: int, block_size: int = 64,
                 retention: Optional[dict] = None, default_ttl: float = math.inf):
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an integer >= 0, got {capacity_blocks!r}")
        _check_block(block_size)
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.retention = dict(retention or {})
        for cls, ttl in list(self.retention.items()) + [("default_ttl", default_ttl)]:
            if not (isinstance(ttl, (int, float)) and ttl > 0):
                raise ValueError(f"retention TTL of class {cls!r} must be > 0 seconds, got {ttl!r}")
        self.default_ttl = default_ttl
        self._blocks: OrderedDict[int, float] = OrderedDict()   # hash -> expiry time
        self.lookups = self.hit_blocks = self.looked_blocks = 0
        self.inserted = self.evicted = self.expired = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def ttl(self, retention_class: str) -> float:
        return self.retention.get(retention_class, self.default_ttl)

    def _alive(self, h: int, now: float) -> bool:
        exp = self._blocks.get(h)
        if exp is None:
            return False
        if exp <= now:
            del self._blocks[h]
            self.expired += 1
            return False
        return True

    def peek(self, hashes: Sequence[int], now: float) -> int:
        """Cached prefix length in blocks, without touching LRU order or counters
        (expired blocks met on the way are still dropped)."""
        n = 0
        for h in hashes:
            if not self._alive(h, now):
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[int], now: float) -> int:
        """Cached prefix length in blocks; the hit blocks become most recently used."""
        n = self.peek(hashes, now)
        self.lookups += 1
        self.looked_blocks += len(hashes)
        self.hit_blocks += n
        for h in reversed(hashes[:n]):
            self._blocks.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[int], now: float, retention_class: str = "default") -> int:
        """Store a chain (at most ``capacity`` leading blocks); returns blocks newly added.
        Written blocks get expiry ``now + ttl(class)`` (a rewrite extends it)."""
        if not self.capacity or not hashes:
            return 0
        chain = hashes[:self.capacity]
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
            for _ in range(excess):
                pop(last=False)
            self.evicted += excess
        return added

    def hit_rate(self) -> float:
        """Fraction of looked-up blocks that hit."""
        return self.hit_blocks / self.looked_blocks if self.looked_blocks else 0.0

    def lru_order(self) -> list[int]:
        """Block hashes from least to most recently used (for tests and inspection)."""
        return list(self._blocks)
