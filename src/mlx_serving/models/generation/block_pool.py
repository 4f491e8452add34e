"""Host-side bookkeeping of the paged KV cache's blocks (vLLM v1's ``block_pool.py`` shape).

Every block has a reference count and, once it is full and computed, may carry a prefix hash
(:func:`block_hash`: the parent block's hash chained with the block's token ids, so equal prefixes
map to equal chains). A block whose count drops to 0 is free: without a hash it goes back to the
plain free list; with one it stays cached (reusable by a later sequence with the same prefix) in
an LRU list, and is evicted, oldest first, only when a block is needed and no plain one is left.
Block 0 is the null block and is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

__all__ = ["BlockPool", "block_hash"]


def block_hash(parent: bytes | None, tokens: np.ndarray) -> bytes:
    """The prefix hash of a full block: 128-bit BLAKE2b over the parent's hash and the block's
    token ids (int32)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    return h.digest()


class BlockPool:
    """``num_blocks`` usable blocks (ids 1..num_blocks; 0 is the null block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * (num_blocks + 1)
        self._hash: list[bytes | None] = [None] * (num_blocks + 1)
        self._by_hash: dict[bytes, int] = {}
        self._plain = list(range(num_blocks, 0, -1))  # pop() hands out 1, 2, 3, ...
        self._lru: OrderedDict[int, None] = OrderedDict()  # free blocks holding a hash, oldest first
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks that can be allocated now (free, cached ones included)."""
        return len(self._plain) + len(self._lru)

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.available

    @property
    def cached_free(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._lru)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (count 1), evicting the least recently freed cached ones when no
        plain block is left; None (nothing taken) when fewer than ``n`` are available."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                h = self._hash[b]
                if h is not None:  # a cached block always has its hash
                    del self._by_hash[h]
                self._hash[b] = None
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def touch(self, block: int) -> None:
        """One more reference to a (cached) block; a free one leaves the LRU list."""
        if self._ref[block] == 0:
            del self._lru[block]
        self._ref[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at 0 the block is free (cached when it carries a hash)."""
        self._ref[block] -= 1
        assert self._ref[block] >= 0, f"block {block} freed twice"
        if self._ref[block] == 0:
            if self._hash[block] is not None:
                self._lru[block] = None
            else:
                self._plain.append(block)

    def lookup(self, h: bytes) -> int | None:
        """The block holding prefix hash ``h``, if cached."""
        return self._by_hash.get(h)

    def register(self, block: int, h: bytes) -> None:
        """Record that full, computed ``block`` holds prefix hash ``h`` (ignored when another
        block already holds it or this one already has a hash)."""
        if h not in self._by_hash and self._hash[block] is None:
            self._by_hash[h] = block
            self._hash[block] = h

    def refcount(self, block: int) -> int:
        return self._ref[block]
