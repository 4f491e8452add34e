"""``GenerationOptions``: serving-wide defaults of the text-generation serving."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from ..decoder.kv_cache import BLOCK_SIZE
from ..generation.config import BUFFER_CACHE_BYTES, EngineConfig, SpeculativeConfig
from ..generation.sampling import SamplingParams, _show

__all__ = ["GPU_STEP_TOKENS", "MAX_STOP_CHARS", "MAX_STOP_STRINGS", "GenerationOptions"]

#: The per-step token budget where shapes are bucketed (a GPU) and none is given: prefill chunks
#: share each step with the decode rows, so a wave of prompts never stalls decoding for long (vLLM's
#: ``max_num_batched_tokens`` default for chunked prefill).
GPU_STEP_TOKENS = 2048

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

    max_new_tokens: most generated tokens per prompt (an EOS counts), >= 1.
    temperature: a finite number >= 0; 0 = greedy (argmax), > 0 samples at that temperature
      (seeded by the request's ``seed``).
    top_p: in (0, 1]; with temperature > 0, sample from the smallest set of most probable tokens
      whose mass reaches top_p (nucleus sampling, Holtzman et al. 2020); 1 = plain temperature
      sampling.
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
    max_step_tokens: the per-step token budget (decode rows one each, then whole prefill chunks);
      None: :data:`GPU_STEP_TOKENS` where shapes are bucketed, else unbounded.
    policy: "fcfs" (first come, first served) or "priority" (each request's ``priority``, lower
      first, ties by arrival; the serving hands every queued request to the engine's scheduler, one
      queue in the policy's order); the running sequence preempted when KV blocks run out is the
      newest (fcfs) or the lowest-priority one.
    kv_cache_bytes: optional KV-cache budget in bytes (the paged block pool).
    kv_cache_fraction: optional KV-cache budget as a fraction in (0, 1] of the device's available
      memory (when kv_cache_bytes is None); default budget: 1 GiB on the CPU, half on a GPU.
    prefix_caching: reuse the KV blocks of cached prompt prefixes (automatic prefix caching).
    block_size: tokens per KV block (16).
    buffer_cache_bytes: the bound on MLX's buffer cache (1 GiB; None: MLX's own).
    decode_path: "fused", "matmul", "sdpa" or None (the fused CUDA kernels where they run and fit,
      else "matmul").
    compile_decode: ``mx.compile`` the decode steps (None: with the fused path only).
    bucket_shapes: pad steps to the shape buckets and build every bucket at start (None: on a GPU,
      off on the CPU).
    pack_prefill: run a multi-row prefill as one packed row (None: the runner decides).
    max_causal_groups: most causal groups of one packed prefill's attention.
    speculative_config: speculative decoding (vLLM's names): None (off), a
      :class:`~..generation.config.SpeculativeConfig`, a mapping of its fields or that mapping as
      a JSON string, e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
      "prompt_lookup_max": 4, "prompt_lookup_min": 2}``; stored as the config.

    Raises ValueError naming the field for any value out of range.
    """

    max_new_tokens: int = 100
    max_len: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
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
    buffer_cache_bytes: int | None = BUFFER_CACHE_BYTES
    decode_path: str | None = None
    compile_decode: bool | None = None
    pack_prefill: bool | None = None
    max_causal_groups: int = 4
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        SamplingParams(self.max_new_tokens, self.temperature, self.top_p)  # validates
        config = self.engine  # checks every engine field (by its part) and keeps the config
        if config.cache.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.max_new_tokens >= self.max_len:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be < max_len {self.max_len}: "
                             "no prompt would fit")

    @cached_property
    def engine(self) -> EngineConfig:
        """The serving's engine configuration: the engine fields by name, with ``max_step_tokens``
        None resolved to :data:`GPU_STEP_TOKENS` where shapes are bucketed. Built (and checked)
        when the options are."""
        config = EngineConfig.of(**{name: getattr(self, name) for name in EngineConfig.field_names()})
        if config.scheduler.max_step_tokens is None and config.decode.bucketed():
            config = replace(config, scheduler=replace(config.scheduler, max_step_tokens=GPU_STEP_TOKENS))
        return config


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
