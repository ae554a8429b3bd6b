"""Cross-request prefix cache of the simulator: the hash-chain LRU index with retention
classes lives in :mod:`pdjax.prefix_index` (one representation, shared with the real
store of the PD engine) and is re-exported here, with the simulator's symbolic prompts.

Block content comes either from real token ids (:func:`token_chain_hashes`, BLAKE2b over the
ids) or from a segment description (:func:`segment_chain_hashes`, the simulator's symbolic
prompts: ``(segment_id, length)`` pairs, equal ids meaning equal tokens, hashed with Python's
tuple hash of ints, the same in every process). The two kinds of key are never mixed in one
cache; each has the chain property: equal keys mean equal prefixes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pdjax.prefix_index import PrefixCache, check_block_size, token_chain_hashes

__all__ = ["PrefixCache", "extend_chain", "segment_chain_hashes", "token_chain_hashes"]

_check_block = check_block_size


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
