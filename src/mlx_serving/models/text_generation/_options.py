"""``GenerationOptions``: serving-wide defaults of the text-generation serving."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any
from pathlib import Path

from ..decoder.kv_cache import BLOCK_SIZE
from .._checkpoint import read_json
from ..decoder.memory import on_cpu
from ..generation.config import EngineConfig, SpeculativeConfig, default_buffer_cache_bytes
from ..generation.sampling import SamplingParams, _show

__all__ = ["CPU_STEP_TOKENS", "DEFAULT_MAX_NEW_TOKENS", "GPU_STEP_TOKENS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS",
           "GenerationOptions", "default_max_new_tokens"]

#: ``max_new_tokens`` when none is given, capped at half of ``max_len`` (:func:`default_max_new_tokens`).
DEFAULT_MAX_NEW_TOKENS = 100

#: The per-step token budget where shapes are bucketed (a GPU) and none is given: prefill chunks
#: share each step with the decode rows, so a wave of prompts never stalls decoding for long (vLLM's
#: ``max_num_batched_tokens`` default for chunked prefill).
GPU_STEP_TOKENS = 2048

#: The per-step token budget on the CPU where none is given: waiting prompts start a few at a time
#: beside the decode rows, so their first tokens come in turn instead of all after the whole wave's
#: prefill (issue 39: the time to first token of 32 streams).
CPU_STEP_TOKENS = 512

# Stop strings are matched in the caller (in a ServingPool: on the worker's event loop, shared by
# every request of that worker) at each token, in time ~ count x length (the held-back tail is at
# most one stop string long). At these caps a token costs at most ~0.12 ms (measured with
# adversarial prefixes: 16 strings of 256 characters, 4,000 tokens); 100,000 one-word stop strings
# cost 180 ms per token.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class GenerationOptions:
    """Defaults for every request of one text-generation serving, and its engine's configuration
    (:attr:`engine`, derived from the fields below once, here).

    Serving fields:

    max_new_tokens: most generated tokens per prompt (an EOS counts) of a request that gives none,
      >= 1 and < max_len; None (the default): ``min(100, max_len // 2)``
      (:func:`default_max_new_tokens`), an int once constructed. A request that gives none gets this
      many capped at what fits after its prompt (``max_len - prompt tokens``, as vLLM's default
      ``max_tokens`` is the context left); one that gives more than fits is refused.
    temperature: a finite number >= 0; 0 = greedy (argmax), > 0 samples at that temperature
      (seeded by the request's ``seed``).
    top_p: in (0, 1]; with temperature > 0, sample from the smallest set of most probable tokens
      whose mass reaches top_p (nucleus sampling, Holtzman et al. 2020); 1 = plain temperature
      sampling.
    top_k, min_p, repetition_penalty: optional defaults of those sampling options (None: the
      sampler's own: off); ``sampling_defaults(path)`` reads them, with temperature and top_p,
      from a checkpoint's generation_config.json (what ``serve --generation-config auto`` uses).
    chat: plain-text inputs become one user message rendered with the chat template.
    stop: stop strings (a string or a list of at most 16, each 1..256 characters); generation ends
      when the text contains one (it is not returned).
    profile_timing: add per-request ``timing`` (ms) to results and final stream events.

    Engine fields (the fields of :class:`~..generation.config.EngineConfig`'s parts, by name; each
    part documents and checks its own; docs/generation.md):

    max_len: KV-cache positions per sequence (prompt + new tokens), >= 2 here.
    max_batch: most sequences decoding at once (KV-cache slots); also the default
      ``batch_size`` of ``Serving.start``.
    prefill_chunk: prompt tokens per sequence per engine step (chunked prefill).
    max_step_tokens: the per-step token budget (decode rows one each, then prefill chunks; waiting
      prompts start while it has room); None: :data:`GPU_STEP_TOKENS` where shapes are bucketed,
      :data:`CPU_STEP_TOKENS` on the CPU, else unbounded.
    policy: "fcfs" (first come, first served) or "priority" (each request's ``priority``, lower
      first, ties by arrival; the serving hands every queued request to the engine's scheduler, one
      queue in the policy's order); the running sequence preempted when KV blocks run out is the
      newest (fcfs) or the lowest-priority one.
    kv_cache_bytes: optional KV-cache budget in bytes (the paged block pool).
    kv_cache_fraction: optional KV-cache budget as a fraction in (0, 1] of the device's available
      memory (when kv_cache_bytes is None); default budget: 1 GiB on the CPU, half on a GPU.
    prefix_caching: reuse the KV blocks of cached prompt prefixes (automatic prefix caching).
    block_size: tokens per KV block (16).
    buffer_cache_bytes: the bound on MLX's buffer cache (0 on the CPU, 1 GiB on a GPU; None:
      MLX's own).
    kv_cache_dtype: what the KV blocks hold: "auto" (the activation dtype, exact), "int8" or
      "int4" (quantized K and V, more blocks in the same budget; docs/generation.md).
    decode_path: "fused", "matmul", "sdpa", "native" or None (the fused CUDA kernels where they run
      and fit, else "native" where it applies, else "matmul"); "native": the CPU decode step with
      int8-activation products (approximate), "matmul": the exact float path (docs/generation.md).
    compile_decode: ``mx.compile`` the decode steps (None: with the fused path only).
    bucket_shapes: pad steps to the shape buckets and build every bucket at start (None: on MLX's
      CUDA build; off on Metal and the CPU).
    pack_prefill: run a multi-row prefill as one packed row (None: the runner decides).
    max_causal_groups: most causal groups of one packed prefill's attention.
    speculative_config: speculative decoding (vLLM's names): None (off), a
      :class:`~..generation.config.SpeculativeConfig`, a mapping of its fields or that mapping as
      a JSON string, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
      "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "draft_model", "model":
      "<draft>", "num_speculative_tokens": 4}``; stored as the config.

    Raises ValueError naming the field for any value out of range.
    """

    max_new_tokens: int | None = None
    max_len: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    chat: bool = False
    stop: tuple[str, ...] = field(default=())
    profile_timing: bool = True
    max_batch: int = 32
    prefill_chunk: int = 512
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    prefix_caching: bool = True
    policy: str = "fcfs"
    max_step_tokens: int | None = None
    bucket_shapes: bool | None = None
    block_size: int = BLOCK_SIZE
    buffer_cache_bytes: int | None = field(default_factory=default_buffer_cache_bytes)
    kv_cache_dtype: str = "auto"
    decode_path: str | None = None
    compile_decode: bool | None = None
    pack_prefill: bool | None = None
    max_causal_groups: int = 4
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        max_new = default_max_new_tokens(self.max_len) if self.max_new_tokens is None else self.max_new_tokens
        object.__setattr__(self, "max_new_tokens", max_new)
        replace(SamplingParams(max_new, self.temperature, self.top_p), **self.sampling_extras())  # validates
        config = self.engine  # checks every engine field (by its part) and keeps the config
        if config.cache.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if max_new >= self.max_len:
            raise ValueError(f"max_new_tokens {max_new} must be < max_len {self.max_len}: "
                             "no prompt would fit (leave max_new_tokens out for a default that fits)")

    def sampling_extras(self) -> dict[str, Any]:
        """The optional sampling defaults that are set (``top_k``, ``min_p``, ``repetition_penalty``).
        Any: SamplingParams keyword arguments by name (each checked by its ``__post_init__``)."""
        return {k: v for k in _EXTRAS if (v := getattr(self, k)) is not None}

    @cached_property
    def engine(self) -> EngineConfig:
        """The serving's engine configuration: the engine fields by name, with ``max_step_tokens``
        None resolved to :data:`GPU_STEP_TOKENS` where shapes are bucketed, :data:`CPU_STEP_TOKENS`
        on the CPU. Built (and checked) when the options are."""
        config = EngineConfig.of(**{name: getattr(self, name) for name in EngineConfig.field_names()})
        if config.scheduler.max_step_tokens is None:
            budget = GPU_STEP_TOKENS if config.decode.bucketed() else CPU_STEP_TOKENS if on_cpu() else None
            config = replace(config, scheduler=replace(config.scheduler, max_step_tokens=budget))
        return config


def default_max_new_tokens(max_len: object, default: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """``min(default, max_len // 2)`` (at least 1): the new tokens of a request that gives none
    when the context is ``max_len`` positions, so a smaller ``max_len`` leaves at least half of it
    to the prompt (a request's default is then capped again to what its prompt leaves).
    ``max_len`` that is not an int gives ``default`` (its own check refuses it)."""
    if isinstance(max_len, bool) or not isinstance(max_len, int):
        return default
    return max(1, min(default, max_len // 2))


def _stop_tuple(stop: object) -> tuple[str, ...]:
    """``stop`` (None, a string, or a list / tuple of strings) as a tuple; ValueError naming ``stop``
    for anything else, an empty string, more than MAX_STOP_STRINGS strings or one longer than
    MAX_STOP_CHARS."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        items: tuple[object, ...] = (stop,)
    elif isinstance(stop, (list, tuple)):
        items = tuple(stop)
    else:
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed")
    strings: list[str] = []
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {_show(s)}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s):,}")
        strings.append(s)
    return tuple(strings)


_EXTRAS = ("top_k", "min_p", "repetition_penalty")
#: The sampling keys a checkpoint's generation_config.json may set as defaults (vLLM's
#: ``--generation-config auto`` reads the same ones).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(checkpoint: Path) -> dict[str, Any]:
    """The sampling defaults ``checkpoint``'s generation_config.json sets (the keys of
    :data:`SAMPLING_DEFAULT_KEYS` holding numbers; ``top_k`` 0 or below means off and is left out);
    ``{}`` without the file. The file is untrusted: read within the checkpoint, size-bounded;
    ValueError naming it when it is malformed or a value is out of range for the sampler."""
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return {}
    raw = read_json(path, checkpoint)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    found: dict[str, Any] = {}  # Any: SamplingParams keyword arguments by name, numbers here
    for key in SAMPLING_DEFAULT_KEYS:
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[key] = value
    if found.get("top_k", 1) <= 0:
        found.pop("top_k")
    try:
        replace(SamplingParams(1), **found)  # __post_init__ checks each value
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return found
