"""The model-agnostic generation core: the continuous-batching :class:`Engine` over a paged KV
cache (block pool, block tables, automatic prefix caching with LRU eviction, preemption).

The shared decoder (``models/decoder/layers.py``, which every family in ``models/families`` runs) provides
the forward pass (``forward(state, cache, rows)`` reading and writing K/V through ``attend``);
everything else (batching, KV memory, sampling, the decode path) is here. Sampling (:mod:`.sampling`, :mod:`.logits`): per-request :class:`SamplingParams` run as a
sampler chain for the whole batch on the device; structured output plugs in through a
:data:`ConstraintFactory` making :class:`TokenConstraint` objects. See docs/generation.md.
"""

from .block_pool import BlockPool, block_hash
from .config import CacheConfig, DecodeConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .engine import Engine
from .events import FinishReason, SeqEvent
from .generate import generate
from ..decoder.kv_cache import BLOCK_SIZE, PagedKVCache, init_paged_kv_cache, plan_blocks
from .kv_cache_manager import KVCacheManager, KVStats, SeqBlocks
from .model_runner import ModelRunner
from .policy import FCFSPolicy, Policy, PriorityPolicy, make_policy
from .protocol import ConstraintFactory, TokenConstraint
from .request import Request
from .sampling import SamplerKind, SamplingParams
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["BLOCK_SIZE", "BlockPool", "CacheConfig", "ConstraintFactory", "DecodeConfig", "Engine", "EngineConfig",
           "FCFSPolicy", "FinishReason", "KVCacheManager", "KVStats", "ModelRunner", "PagedKVCache", "Policy",
           "PriorityPolicy", "Request", "SamplerKind", "SamplingParams", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SeqBlocks", "SeqEvent", "SpeculativeConfig", "TokenConstraint", "block_hash", "generate",
           "init_paged_kv_cache", "make_policy", "plan_blocks"]
