"""Per-sequence block tables over a :class:`~.block_pool.BlockPool`, with automatic prefix caching
(vLLM v1's ``kv_cache_manager.py`` shape).

A sequence's token stream (prompt, then generated tokens) is cut into blocks of ``block_size``;
its block table lists the blocks holding them. On admission the full blocks of its stream are
hashed in a chain (:func:`~.block_pool.block_hash`) and every block of the longest cached prefix
is reused (shared, reference counted); the rest is allocated fresh and prefilled. At least one
token is always recomputed, so the last prompt position has logits: the hit stops at
``(len - 1) // block_size`` blocks. As blocks fill up with computed K/V whose tokens are known,
:meth:`KVManager.commit` registers their hashes, so a later sequence (or this one, recomputed
after a preemption) can reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .block_pool import BlockPool, block_hash

__all__ = ["KVManager", "KVStats", "SeqBlocks"]


@dataclass
class SeqBlocks:
    """One sequence's block table and the prefix hashes of its full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chained hash of stream block j (kept across frees)
    committed: int = 0  # leading blocks already offered to the prefix cache


@dataclass(frozen=True)
class KVStats:
    """Counters of the paged KV cache (``Engine.kv_stats()``).

    Blocks: ``blocks_total`` usable blocks of ``block_size`` tokens; ``blocks_used`` referenced by
    a sequence; ``blocks_free`` allocatable (``blocks_cached`` of them still hold a cached
    prefix). Prefix cache: ``prefix_queries`` sequences looked up at admission (a sequence
    recomputed after a preemption is looked up again), ``prefix_hits`` of them reused at least one
    block, ``prefix_query_tokens`` / ``prefix_hit_tokens`` their tokens / the tokens reused.
    ``preemptions``: sequences preempted for blocks; ``evictions``: cached blocks reused for
    other content."""

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_queries: int
    prefix_hits: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    evictions: int


class KVManager:
    """Block tables for the engine's sequences; ``prefix_caching`` False disables reuse."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.queries = self.hits = self.query_tokens = self.hit_tokens = self.preemptions = 0

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _extend_hashes(self, sb: SeqBlocks, tokens: np.ndarray, n_blocks: int) -> None:
        bs = self.block_size
        for j in range(len(sb.hashes), n_blocks):
            sb.hashes.append(block_hash(sb.hashes[j - 1] if j else None, tokens[j * bs : (j + 1) * bs]))

    def cached_prefix(self, sb: SeqBlocks, tokens: np.ndarray) -> list[int]:
        """Blocks of the longest cached prefix of ``tokens`` (leaving at least one token)."""
        if not self.prefix_caching:
            return []
        n = (len(tokens) - 1) // self.block_size
        self._extend_hashes(sb, tokens, n)
        hit = []
        for h in sb.hashes[:n]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def admit(self, sb: SeqBlocks, tokens: np.ndarray, first_chunk: int) -> int | None:
        """Give a starting sequence its cached prefix plus fresh blocks for its next
        ``first_chunk`` tokens (at most the rest of ``tokens``). Returns the number of tokens
        reused from the cache, or None (nothing taken) when the blocks are not available."""
        hit = self.cached_prefix(sb, tokens)
        for b in hit:
            self.pool.touch(b)
        reused = len(hit) * self.block_size
        first = min(first_chunk, len(tokens) - reused)
        new = self.pool.allocate(self._blocks_for(reused + first) - len(hit))
        if new is None:
            for b in hit:
                self.pool.free(b)
            return None
        sb.blocks, sb.committed = hit + new, len(hit)
        self.queries += 1
        self.hits += bool(hit)
        self.query_tokens += len(tokens)
        self.hit_tokens += reused
        return reused

    def ensure(self, sb: SeqBlocks, n_tokens: int) -> bool:
        """Grow the block table to hold ``n_tokens`` positions; False (nothing taken) when the
        pool has too few blocks."""
        need = self._blocks_for(n_tokens) - len(sb.blocks)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        sb.blocks += new
        return True

    def commit(self, sb: SeqBlocks, tokens: np.ndarray, n_written: int) -> None:
        """Offer the full blocks among the first ``min(len(tokens), n_written)`` positions (known
        tokens whose K/V has been written) to the prefix cache."""
        if not self.prefix_caching:
            return
        n = min(len(tokens), n_written, len(sb.blocks) * self.block_size) // self.block_size
        if n <= sb.committed:
            return
        self._extend_hashes(sb, tokens, n)
        for j in range(sb.committed, n):
            self.pool.register(sb.blocks[j], sb.hashes[j])
        sb.committed = n

    def free(self, sb: SeqBlocks) -> None:
        """Return a sequence's blocks (last block first, so a prefix's tail is evicted before
        its head); cached ones stay reusable."""
        for b in reversed(sb.blocks):
            self.pool.free(b)
        sb.blocks, sb.committed = [], 0

    def stats(self) -> KVStats:
        p = self.pool
        return KVStats(self.block_size, p.num_blocks, p.used, p.available, p.cached_free, self.queries, self.hits,
                       self.query_tokens, self.hit_tokens, self.preemptions, p.evictions)
