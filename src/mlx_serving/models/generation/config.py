"""The one engine configuration: :class:`EngineConfig`, split by concern as vLLM's ``VllmConfig``.

:class:`SchedulerConfig` (rows, chunked prefill, the per-step token budget, the queue policy),
:class:`CacheConfig` (sequence length, the paged KV block pool, prefix caching, MLX's buffer
cache), :class:`DecodeConfig` (how steps run: decode path, compilation, shape buckets, packed
prefill) and :class:`SpeculativeConfig` (speculative decoding, vLLM's ``speculative_config``; None:
off). Each part checks its own fields when built (ValueError naming the field); the
text-generation serving builds one from its options (``GenerationOptions.engine``), the CLI from
its flags through those options, and :class:`~.engine.Engine` reads it: built once, passed down,
never copied field by field. :meth:`EngineConfig.of` builds one from flat keywords (the fields of
the parts by name; the speculative part as ``speculative_config``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..decoder.decode_backends import DECODE_PATHS, DecodeBackend
from ..decoder.kv_cache import BLOCK_SIZE, KV_CACHE_DTYPES
from ..decoder.memory import on_cpu, on_cuda
from .policy import Policy
from .sampling import _show

__all__ = ["BUFFER_CACHE_BYTES", "CPU_BUFFER_CACHE_BYTES", "POLICIES", "SPECULATIVE_METHODS", "CacheConfig",
           "DecodeConfig", "EngineConfig", "SchedulerConfig", "SpeculativeConfig", "default_buffer_cache_bytes"]

#: MLX's buffer cache bound an engine sets by default on a GPU (``mx.set_cache_limit``): freed
#: buffers MLX keeps for reuse. Unbounded, the warm-up's transient buffers stayed cached (18.2 GB of
#: 25.7 GB in use on the H200 at the text-generation defaults, issue 26).
BUFFER_CACHE_BYTES = 1 << 30

#: The default bound on the CPU (0: no cache): freed buffers go back to the C allocator, which
#: reuses them as cheaply. At 1 GiB the cache held ~200 MiB at 32 streams (the prefill's many
#: shapes), at 16 MiB 15 MiB (22 MiB of a 32-stream server's peak RSS), for no speed measured
#: (docs/benchmarks.md, issue 42: CPU time per prefill token and per 1- and 32-row native step
#: within noise of 1 GiB's, 16 MiB's and 0's).
CPU_BUFFER_CACHE_BYTES = 0


def default_buffer_cache_bytes() -> int:
    """The default ``buffer_cache_bytes``: :data:`CPU_BUFFER_CACHE_BYTES` where MLX's default
    device is the CPU (when the config is built), else :data:`BUFFER_CACHE_BYTES`."""
    return CPU_BUFFER_CACHE_BYTES if on_cpu() else BUFFER_CACHE_BYTES


#: The queue policies by name (:func:`~.policy.make_policy`).
POLICIES = ("fcfs", "priority")

#: Speculative decoding methods (vLLM's ``speculative_config["method"]``) this engine runs.
SPECULATIVE_METHODS = ("ngram", "draft_model")


def _positive(name: str, value: object, *, optional: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= 1 (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an integer >= 1, got {_show(value)}")


def _flag(name: str, value: object, *, optional: bool = True) -> None:
    """ValueError naming ``name`` unless ``value`` is a bool (or None when ``optional``)."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} must be {'None or ' if optional else ''}a bool, got {_show(value)}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Who runs each step (:class:`~.scheduler.Scheduler`).

    max_batch: most sequences decoding at once (rows), >= 1 (vLLM's ``max_num_seqs``).
    prefill_chunk: most prompt tokens per sequence per step (chunked prefill), >= 1.
    max_step_tokens: the per-step token budget shared by the decode rows (one token each, always
      scheduled) and the prefill chunks (given in start order from what is left); None: every
      prefilling sequence gets its ``prefill_chunk`` (vLLM's ``max_num_batched_tokens``). With
      shape bucketing the budget never cuts a chunk short (see :class:`DecodeConfig`).
    policy: "fcfs" (first come, first served) or "priority" (``Engine.add(..., priority=)``,
      lower first) or a :class:`~.policy.Policy` object: orders the waiting sequences and picks
      who is preempted.

    Raises ValueError naming the field for a value out of range.
    """

    max_batch: int = 32
    prefill_chunk: int = 512
    max_step_tokens: int | None = None
    policy: str | Policy = "fcfs"

    def __post_init__(self) -> None:
        _positive("max_batch", self.max_batch)
        _positive("prefill_chunk", self.prefill_chunk)
        _positive("max_step_tokens", self.max_step_tokens, optional=True)
        if isinstance(self.policy, str) and self.policy not in POLICIES:
            raise ValueError(f"policy must be 'fcfs', 'priority' or a Policy object, got {_show(self.policy)}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV memory (:mod:`..decoder.kv_cache`, :class:`~.kv_cache_manager.KVCacheManager`).

    max_len: KV positions per sequence (prompt + new tokens), >= 1.
    block_size: tokens per KV block, >= 1 (16).
    kv_cache_bytes: the block pool's budget in bytes; None: ``kv_cache_fraction``, else the default
      (1 GiB on the CPU, half the available memory on a GPU); never more blocks than
      ``max_batch x ceil(max_len / block_size)``. A budget that holds no sequence of ``max_len``
      raises ValueError when the engine is built.
    kv_cache_fraction: the budget as a fraction in (0, 1] of the device's available memory (when
      ``kv_cache_bytes`` is None; vLLM's ``gpu_memory_utilization`` covers the weights too).
    prefix_caching: reuse the KV blocks of cached prompt prefixes (automatic prefix caching).
    buffer_cache_bytes: the bound set on MLX's buffer cache when the engine is built, process-wide
      (:func:`default_buffer_cache_bytes`: 0 on the CPU, 1 GiB on a GPU); None: left as it is.
    kv_cache_dtype: what the blocks hold (vLLM's name): "auto", the activation dtype (the exact
      float cache), but float16 under the native CPU decode step (llama.cpp's default f16 cache:
      :data:`..decoder.decode_backends.NATIVE_AUTO_KV`); "float16" / "bfloat16", K and V rounded
      to that dtype when written; "int8" / "int4", K and V quantized when written (MLX's affine layout, one
      scale and bias per head vector: :mod:`..decoder.kv_cache`) and dequantized when attention
      reads them: smaller blocks, so more of them in the budget; approximate (docs/generation.md).

    Raises ValueError naming the field for a value out of range.
    """

    max_len: int = 2048
    block_size: int = BLOCK_SIZE
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    prefix_caching: bool = True
    buffer_cache_bytes: int | None = field(default_factory=default_buffer_cache_bytes)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _positive("max_len", self.max_len)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {_show(self.kv_cache_dtype)}")
        _positive("block_size", self.block_size)
        k = self.kv_cache_bytes  # its range against max_len: plan_blocks, when the engine is built
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise ValueError(f"kv_cache_bytes must be None or an integer, got {_show(k)}")
        f = self.kv_cache_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_cache_fraction must be None or a number in (0, 1], got {_show(f)}")
        _flag("prefix_caching", self.prefix_caching, optional=False)
        b = self.buffer_cache_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValueError(f"buffer_cache_bytes must be None or an integer >= 0, got {_show(b)}")


@dataclass(frozen=True)
class DecodeConfig:
    """How steps run on the device (:class:`~.model_runner.ModelRunner`).

    decode_path: how one-token rows attend (:func:`~..decoder.decode_backends.decode_backend`):
      "fused", "matmul" (the exact path), "native", "sdpa", a backend object, or None for the
      fused CUDA kernels where they run and fit, else the native CPU step where it applies (CPU,
      float32 activations, affine 4/8-bit weights; int8 activations, approximate), else "matmul".
    compile_decode: run decode steps through ``mx.compile``d graphs; None: on with the fused path,
      off elsewhere.
    bucket_shapes: pad batches to shape buckets, built by ``Engine.warm_up``; None: on for a GPU,
      off on the CPU (:meth:`bucketed`). With buckets the step budget never cuts a prefill chunk
      short (a chunk waits for a step with room) and a cached prefix is reused in whole
      ``prefill_chunk`` multiples, so every chunk starts on a warmed shape.
    pack_prefill: run a multi-row prefill as one packed row (None: the runner decides).
    max_causal_groups: most causal groups of one packed prefill's attention, >= 1.

    Raises ValueError naming the field for a value out of range (an unknown ``decode_path`` name
    included; whether the fused path runs here is checked when the engine is built).
    """

    decode_path: str | DecodeBackend | None = None
    compile_decode: bool | None = None
    bucket_shapes: bool | None = None
    pack_prefill: bool | None = None
    max_causal_groups: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.decode_path, str) and self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {list(DECODE_PATHS)} or None, got {_show(self.decode_path)}")
        _flag("compile_decode", self.compile_decode)
        _flag("bucket_shapes", self.bucket_shapes)
        _flag("pack_prefill", self.pack_prefill)
        _positive("max_causal_groups", self.max_causal_groups)

    def bucketed(self) -> bool:
        """Whether steps are padded to shape buckets on the default device (``bucket_shapes``, or
        None: MLX's CUDA build, where a new shape costs a graph build; not Metal or the CPU, which
        run prompts packed and unpadded)."""
        return on_cuda() if self.bucket_shapes is None else self.bucket_shapes


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/generation.md, "Speculative decoding"), vLLM's
    ``speculative_config`` names.

    method: "ngram" (prompt lookup: drafts copied from the row's own prompt and output after the
      latest earlier occurrence of its last n tokens; no second model) or "draft_model" (a smaller
      model sharing the target's tokenizer proposes the drafts, :mod:`.spec_decode.draft`).
    model: the draft model of "draft_model" (whatever ``--model`` takes: a checkpoint directory, a
      .gguf file, a Hugging Face repo id, a packaged or seeded name; loaded when the engine is
      built); must be None for "ngram".
    num_speculative_tokens: most draft tokens per row per step (k), >= 1; each row lowers its own
      k, or stops proposing for a while, when its drafts are rejected.
    prompt_lookup_max / prompt_lookup_min: the longest / shortest n-gram matched, >= 1, min <= max
      (the longest match found wins; "ngram" only).

    Raises ValueError naming the field for a value out of range, an unknown method, or a ``model``
    missing for "draft_model" (or given for "ngram").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {list(SPECULATIVE_METHODS)}, got {_show(self.method)}")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min must be <= prompt_lookup_max={self.prompt_lookup_max}, "
                             f"got {self.prompt_lookup_min}")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be the draft model's name or path for method 'draft_model', "
                             f"got {_show(self.model)}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"model must be None for method 'ngram' (no draft model), got {_show(self.model)}")

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """``value`` as a config: None (off), a SpeculativeConfig, a mapping of its fields by name,
        or that mapping as a JSON string (the ``--speculative-config`` flag). Raises ValueError
        naming ``speculative_config`` for anything else, unknown keys or bad JSON, and naming the
        field for a bad value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be None, a mapping or a JSON object, got {_show(value)}")
        unknown = sorted(set(value) - set(_names(cls)))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} (known: {list(_names(cls))})")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~.engine.Engine` is built with, by concern: ``scheduler``, ``cache``,
    ``decode`` and ``speculative`` (None: no speculative decoding), each checked when built."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    speculative: SpeculativeConfig | None = None

    @classmethod
    def of(cls, **options: Any) -> EngineConfig:
        """The config with ``options`` (fields of the three parts by name, and ``speculative_config``:
        whatever :meth:`SpeculativeConfig.parse` takes; the rest at their defaults), e.g.
        ``EngineConfig.of(max_batch=4, max_len=256, block_size=8)``. Raises TypeError for a name no
        part has, ValueError (naming it) for a bad value."""
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unknown engine options {unknown} (known: {sorted(cls.field_names())})")

        def pick(part: type) -> dict[str, Any]:
            return {k: v for k, v in options.items() if k in _names(part)}

        return cls(SchedulerConfig(**pick(SchedulerConfig)), CacheConfig(**pick(CacheConfig)),
                   DecodeConfig(**pick(DecodeConfig)), SpeculativeConfig.parse(options.get("speculative_config")))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields of the three parts, by name (no two parts share one), and
        ``speculative_config``."""
        parts = (SchedulerConfig, CacheConfig, DecodeConfig)
        return tuple(name for part in parts for name in _names(part)) + ("speculative_config",)


def _names(part: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(part))
