"""Prefix caches over a :class:`~.block_pool.BlockPool`: :class:`HashPrefixCache` (automatic
prefix caching, vLLM v1's) and :class:`NoPrefixCache`, the same interface doing nothing, for an
engine built with ``prefix_caching=False`` (SGLang's ``ChunkCache`` beside its radix cache): the
engine never asks which one it has.

A sequence's token stream (prompt, then generated tokens) is cut into blocks of ``block_size``.
On admission the full blocks of its stream are hashed in a chain (:func:`~.block_pool.block_hash`)
and every block of the longest cached prefix is reused (shared, reference counted). At least one
token is always recomputed, so the last prompt position has logits: the hit stops at
``(len - 1) // block_size`` blocks. As blocks fill with computed K/V whose tokens are known,
:meth:`PrefixCache.commit` registers their hashes, so a later sequence (or this one, recomputed
after a preemption) can reuse them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .block_pool import BlockPool, block_hash

__all__ = ["HashPrefixCache", "NoPrefixCache", "PrefixCache", "SeqBlocks", "prefix_cache"]


@dataclass
class SeqBlocks:
    """One sequence's block table and the prefix hashes of its full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hash of stream block j (kept across frees)
    committed: int = 0  # leading blocks already offered to the prefix cache


class PrefixCache(Protocol):
    """What the KV manager and the engine ask of a prefix cache."""

    def lookup(self, sb: SeqBlocks, tokens: np.ndarray) -> list[int]:
        """Blocks of the longest cached prefix of ``tokens`` (leaving at least one token)."""

    def commit(self, sb: SeqBlocks, n_full: int, tokens: Callable[[], np.ndarray]) -> None:
        """Offer the sequence's first ``n_full`` blocks (full, their tokens known and their K/V
        written; ``tokens()``: the sequence's stream, read only when needed) for reuse; afterwards
        ``sb.committed`` is ``n_full``."""

    def prefilling_elsewhere(self, sb: SeqBlocks, tokens: np.ndarray, prefilling: Iterable[SeqBlocks]) -> bool:
        """True when one of the ``prefilling`` sequences is computing the first block of ``tokens``
        that the cache lacks (the same hash chain): the caller then waits for that block."""


class NoPrefixCache:
    """Prefix caching off: nothing is found, kept or waited for."""

    def lookup(self, sb: SeqBlocks, tokens: np.ndarray) -> list[int]:
        return []

    def commit(self, sb: SeqBlocks, n_full: int, tokens: Callable[[], np.ndarray]) -> None:
        sb.committed = max(sb.committed, n_full)

    def prefilling_elsewhere(self, sb: SeqBlocks, tokens: np.ndarray, prefilling: Iterable[SeqBlocks]) -> bool:
        return False


class HashPrefixCache:
    """Automatic prefix caching: full blocks by the chained hash of their tokens in ``pool``."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool, self.block_size = pool, block_size

    def _extend_hashes(self, sb: SeqBlocks, tokens: np.ndarray, n_blocks: int) -> None:
        bs = self.block_size
        for j in range(len(sb.hashes), n_blocks):
            sb.hashes.append(block_hash(sb.hashes[j - 1] if j else None, tokens[j * bs : (j + 1) * bs]))

    def lookup(self, sb: SeqBlocks, tokens: np.ndarray) -> list[int]:
        n = (len(tokens) - 1) // self.block_size
        self._extend_hashes(sb, tokens, n)
        hit = []
        for h in sb.hashes[:n]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def commit(self, sb: SeqBlocks, n_full: int, tokens: Callable[[], np.ndarray]) -> None:
        n = min(n_full, len(sb.blocks))
        if n <= sb.committed:
            return
        self._extend_hashes(sb, tokens(), n)
        for j in range(sb.committed, n):
            self.pool.register(sb.blocks[j], sb.hashes[j])
        sb.committed = n

    def prefilling_elsewhere(self, sb: SeqBlocks, tokens: np.ndarray, prefilling: Iterable[SeqBlocks]) -> bool:
        """n completions of one prompt added together prefill it once: vLLM v1 shares it the same
        way, through prefix caching."""
        full = (len(tokens) - 1) // self.block_size
        hit = len(self.lookup(sb, tokens))
        if hit >= full:
            return False
        h = sb.hashes[hit]
        return any(len(other.hashes) > hit and other.hashes[hit] == h for other in prefilling)


def prefix_cache(pool: BlockPool, block_size: int, enabled: bool) -> PrefixCache:
    """:class:`HashPrefixCache` over ``pool`` when ``enabled``, else :class:`NoPrefixCache`."""
    return HashPrefixCache(pool, block_size) if enabled else NoPrefixCache()
