"""The model-agnostic generation core: the continuous-batching :class:`Engine` over a paged KV
cache (block pool, block tables, automatic prefix caching with LRU eviction, preemption).

Model families (``models/qwen3``, ...) provide the forward pass (``forward(state, cache, rows)``
reading and writing K/V through ``attend``); everything else (batching, KV memory, sampling) is
here. See docs/generation.md.
"""

from .block_pool import BlockPool, block_hash
from .engine import Engine
from .kv_cache import BLOCK_SIZE, PagedKVCache, init_paged_kv_cache, plan_blocks
from .kv_manager import KVManager, KVStats, SeqBlocks
from .policy import FCFSPolicy, Policy, PriorityPolicy, make_policy

__all__ = ["BLOCK_SIZE", "BlockPool", "Engine", "FCFSPolicy", "KVManager", "KVStats", "PagedKVCache", "Policy",
           "PriorityPolicy", "SeqBlocks", "block_hash", "init_paged_kv_cache", "make_policy", "plan_blocks"]
