"""The model-agnostic generation core: the continuous-batching :class:`Engine` over a paged KV
cache (block pool, block tables, automatic prefix caching with LRU eviction, preemption).

The shared decoder (``models/layers.py``, which every family in ``models/families`` runs) provides
the forward pass (``forward(state, cache, rows)`` reading and writing K/V through ``attend``);
everything else (batching, KV memory, sampling, the decode path) is here. Sampling (:mod:`.sampling`, :mod:`.logits`): per-request :class:`SamplingParams` run as a
sampler chain for the whole batch on the device; structured output plugs in through a
:data:`ConstraintFactory` making :class:`TokenConstraint` objects. See docs/generation.md.
"""

from .block_pool import BlockPool, block_hash
from .engine import Engine
from .events import FinishReason, SeqEvent
from .generate import generate
from .kv_cache import BLOCK_SIZE, PagedKVCache, init_paged_kv_cache, plan_blocks
from .kv_manager import KVManager, KVStats, SeqBlocks
from .policy import FCFSPolicy, Policy, PriorityPolicy, make_policy
from .protocol import ConstraintFactory, TokenConstraint
from .sampling import SamplerKind, SamplingParams
from .slot_cache import KVCache, init_kv_cache

__all__ = ["BLOCK_SIZE", "BlockPool", "ConstraintFactory", "Engine", "FCFSPolicy", "FinishReason", "KVCache", "KVManager",
           "KVStats", "PagedKVCache", "Policy", "PriorityPolicy", "SamplerKind", "SamplingParams", "SeqBlocks", "SeqEvent",
           "TokenConstraint", "block_hash", "generate", "init_kv_cache", "init_paged_kv_cache", "make_policy",
           "plan_blocks"]
