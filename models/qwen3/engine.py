"""Moved: the continuous-batching engine is model-agnostic and lives in
:mod:`models.generation.engine` (paged KV cache, prefix caching, preemption, policies).
Re-exported here so ``from mlx_serving.models.qwen3.engine import Engine`` keeps working."""

from ..generation.engine import Engine

__all__ = ["Engine"]
