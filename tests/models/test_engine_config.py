"""The one engine configuration (models/generation/config.py): each part checks its own fields by
name, ``EngineConfig.of`` routes flat keywords to the parts, the text-generation serving derives
its config once from ``GenerationOptions`` (every engine field reachable there), and the engine is
built from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import pytest

from mlx_serving.models.generation import (CacheConfig, DecodeConfig, Engine, EngineConfig, SamplingParams,
                                           SchedulerConfig, SpeculativeConfig)
from mlx_serving.models.text_generation import GenerationOptions
from mlx_serving.models.text_generation._backend import GenerationBackend
from mlx_serving.models.text_generation._inputs import Prompt
from mlx_serving.models.text_generation._options import CPU_STEP_TOKENS, GPU_STEP_TOKENS

#: A value other than the default for every engine field (all valid together on the CPU).
_OTHER: dict[str, Any] = dict(max_batch=3, prefill_chunk=8, max_step_tokens=40, policy="priority", max_len=96,
                              block_size=8, kv_cache_bytes=None, kv_cache_fraction=0.01, prefix_caching=False,
                              buffer_cache_bytes=1 << 20, decode_path="sdpa", compile_decode=True,
                              bucket_shapes=False, pack_prefill=False, max_causal_groups=2, kv_cache_dtype="int8",
                              speculative_config=SpeculativeConfig(num_speculative_tokens=3))


@pytest.mark.parametrize("part, field, bad", [
    (SchedulerConfig, "max_batch", 0), (SchedulerConfig, "max_batch", 2.0), (SchedulerConfig, "prefill_chunk", True),
    (SchedulerConfig, "max_step_tokens", 0), (SchedulerConfig, "max_step_tokens", "64"),
    (SchedulerConfig, "policy", "lifo"),
    (CacheConfig, "max_len", 0), (CacheConfig, "block_size", 0), (CacheConfig, "kv_cache_bytes", 5.0),
    (CacheConfig, "kv_cache_fraction", 0), (CacheConfig, "kv_cache_fraction", 1.5),
    (CacheConfig, "kv_cache_fraction", True), (CacheConfig, "prefix_caching", 1), (CacheConfig, "prefix_caching", None),
    (CacheConfig, "buffer_cache_bytes", -1), (CacheConfig, "buffer_cache_bytes", 1.0),
    (CacheConfig, "kv_cache_dtype", "fp8"), (CacheConfig, "kv_cache_dtype", None),
    (DecodeConfig, "decode_path", "flash"), (DecodeConfig, "compile_decode", 1), (DecodeConfig, "bucket_shapes", "yes"),
    (DecodeConfig, "pack_prefill", 0), (DecodeConfig, "max_causal_groups", 0),
])
def test_each_part_refuses_a_bad_field_by_name(part: type, field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        part(**{field: bad})
    with pytest.raises(ValueError, match=f"^{field} must be"):  # through the flat constructor
        EngineConfig.of(**{field: bad})


def test_of_routes_every_field_to_its_part_and_refuses_unknown_names() -> None:
    config = EngineConfig.of(**_OTHER)
    parts = (config.scheduler, config.cache, config.decode)
    fields = {f.name: getattr(p, f.name) for p in parts for f in dataclasses.fields(p)}
    assert fields | {"speculative_config": config.speculative} == _OTHER
    assert sorted(EngineConfig.field_names()) == sorted(_OTHER)  # no two parts share a name
    assert EngineConfig.of() == EngineConfig()
    with pytest.raises(TypeError, match="max_num_seqs"):
        EngineConfig.of(max_num_seqs=4)


def test_generation_options_reach_every_engine_field() -> None:
    """Each engine field given to GenerationOptions lands in its one EngineConfig (derived by name,
    no field copied by hand); the GPU step budget fills a bucketed serving's None budget, the CPU
    one a CPU serving's."""
    opts = GenerationOptions(max_new_tokens=4, **_OTHER)
    assert opts.engine == EngineConfig.of(**_OTHER)
    assert set(EngineConfig.field_names()) <= {f.name for f in dataclasses.fields(GenerationOptions)}
    cpu = GenerationOptions(bucket_shapes=False).engine  # the tests run on the CPU
    assert cpu == EngineConfig.of(bucket_shapes=False, max_step_tokens=CPU_STEP_TOKENS)  # one set of defaults
    assert GenerationOptions(bucket_shapes=True).engine.scheduler.max_step_tokens == GPU_STEP_TOKENS
    assert GenerationOptions(bucket_shapes=True, max_step_tokens=7).engine.scheduler.max_step_tokens == 7
    assert GenerationOptions(bucket_shapes=False, max_step_tokens=7).engine.scheduler.max_step_tokens == 7
    for field, bad in (("block_size", 0), ("decode_path", "flash"), ("max_causal_groups", 0),
                       ("buffer_cache_bytes", -1), ("max_batch", 0), ("policy", "lifo")):
        with pytest.raises(ValueError, match=field):
            GenerationOptions(**{field: bad})


def test_the_serving_builds_its_engine_from_the_options_config(tiny32) -> None:
    previous = mx.set_cache_limit(0)
    try:
        opts = GenerationOptions(max_new_tokens=4, max_len=64, max_batch=2, block_size=8, decode_path="sdpa",
                                 buffer_cache_bytes=3 << 20, kv_cache_fraction=0.001)
        backend = GenerationBackend(tiny32, opts)
        engine = backend.init("inline", None, 1)
        assert engine.config is opts.engine
        assert mx.set_cache_limit(previous) == 3 << 20  # the engine bounded MLX's buffer cache
    finally:
        mx.set_cache_limit(previous)
    assert engine.kv_stats().block_size == 8 and engine.decode_backend.name == "sdpa"
    backend.admit(engine, [(0, Prompt(list(range(1, 20)), SamplingParams(4)))], 0)
    events = []
    while backend.active(engine):
        events += backend.step(engine)
    assert len(events) == 4 and backend.kv_stats(engine).blocks_used == 0
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(tiny32, 2)  # type: ignore[arg-type]  # the old positional max_batch
