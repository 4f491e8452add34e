"""Per-sequence block tables over a :class:`~.block_pool.BlockPool` and a prefix cache
(:mod:`.prefix_cache`; vLLM v1's ``kv_cache_manager.py`` shape): admission with the longest
cached prefix reused and fresh blocks for the first chunk, growth on demand, frees, counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .block_pool import BlockPool
from .prefix_cache import PrefixCache, SeqBlocks, prefix_cache

__all__ = ["KVCacheManager", "KVStats", "SeqBlocks"]


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


class KVCacheManager:
    """The scheduler's one view of KV memory (vLLM v1's ``KVCacheManager``): per-request block
    tables (:class:`SeqBlocks`) over a :class:`~.block_pool.BlockPool` of ``num_blocks`` blocks of
    ``block_size`` tokens, and ``prefix``, the prefix cache (``prefix_caching`` False: a prefix
    cache that does nothing, :class:`~.prefix_cache.NoPrefixCache`, SGLang's ``ChunkCache`` shape).
    ``prefix_align``: a cached prefix is reused in whole multiples of this many tokens (a multiple
    of ``block_size``; the GPU's ``prefill_chunk``, so that a hit's first chunk starts where the
    warmed prefill shapes do); 0 or ``block_size``: any number of blocks."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, prefix_align: int = 0):
        if prefix_align % block_size:
            raise ValueError(f"prefix_align {prefix_align} is not a multiple of block_size {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_align = max(prefix_align, block_size)
        self.prefix: PrefixCache = prefix_cache(self.pool, block_size, prefix_caching)
        self.queries = self.hits = self.query_tokens = self.hit_tokens = self.preemptions = 0

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def admit(self, sb: SeqBlocks, tokens: np.ndarray, first_chunk: int) -> int | None:
        """Give a starting sequence its cached prefix plus fresh blocks for its next
        ``first_chunk`` tokens (at most the rest of ``tokens``). Returns the number of tokens
        reused from the cache, or None (nothing taken) when the blocks are not available."""
        hit = self.prefix.lookup(sb, tokens)
        hit = hit[: len(hit) * self.block_size // self.prefix_align * self.prefix_align // self.block_size]
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
