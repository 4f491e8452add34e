"""``GenerationOptions``: serving-wide defaults of the text-generation serving."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..decoder.decode_backends import DECODE_PATHS
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
    """Defaults for every request of one text-generation serving.

    max_new_tokens: most generated tokens per prompt (an EOS counts), >= 1.
    max_len: KV-cache positions per sequence (prompt + new tokens), >= 2.
    temperature: a finite number >= 0; 0 = greedy (argmax), > 0 samples at that temperature
      (seeded by the request's ``seed``).
    top_p: in (0, 1]; with temperature > 0, sample from the smallest set of most probable tokens
      whose mass reaches top_p (nucleus sampling, Holtzman et al. 2020); 1 = plain temperature
      sampling.
    chat: plain-text inputs become one user message rendered with the chat template.
    stop: stop strings (a string or a list of at most 16, each 1..256 characters); generation ends
      when the text contains one (it is not returned).
    profile_timing: add per-request ``timing`` (ms) to results and final stream events.
    max_batch: most sequences decoding at once (KV-cache slots); also the default
      ``batch_size`` of ``Serving.start``.
    prefill_chunk: prompt tokens per sequence per engine step (chunked prefill).
    kv_cache_bytes: optional KV-cache budget in bytes (the paged block pool; docs/generation.md).
    kv_cache_fraction: optional KV-cache budget as a fraction in (0, 1] of the device's available
      memory (when kv_cache_bytes is None); default budget: 1 GiB on the CPU, half on a GPU.
    prefix_caching: reuse the KV blocks of cached prompt prefixes (automatic prefix caching).
    max_step_tokens: the per-step token budget (decode rows one each, then whole prefill chunks;
      docs/generation.md); None: :data:`GPU_STEP_TOKENS` where shapes are bucketed, else unbounded.
    bucket_shapes: pad steps to the shape buckets and build every bucket at start (None: on a GPU,
      off on the CPU; docs/generation.md).
    policy: "fcfs" (first come, first served) or "priority" (each request's ``priority``, lower
      first, ties by arrival; the serving hands every queued request to the engine's scheduler, one
      queue in the policy's order); the running
      sequence preempted when KV blocks run out is the newest (fcfs) or the lowest-priority one.
    decode_path: the engine's decode backend by name (None: the default; "native": the CPU decode
      step with int8-activation products, docs/generation.md; ``Engine(decode_path=)``).

    Raises ValueError for any value out of range.
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
    decode_path: str | None = None

    def step_tokens(self) -> int | None:
        """The engine's ``max_step_tokens`` (see the field)."""
        bucketed = mx.default_device() == mx.gpu if self.bucket_shapes is None else self.bucket_shapes
        return self.max_step_tokens if self.max_step_tokens is not None else (GPU_STEP_TOKENS if bucketed else None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        SamplingParams(self.max_new_tokens, self.temperature, self.top_p)  # validates
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.max_new_tokens >= self.max_len:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be < max_len {self.max_len}: "
                             "no prompt would fit")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError(f"max_batch and prefill_chunk must be >= 1, got {self.max_batch}, {self.prefill_chunk}")
        f = self.kv_cache_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_cache_fraction must be None or a number in (0, 1], got {_show(f)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {_show(self.policy)}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a bool, got {_show(self.prefix_caching)}")
        m = self.max_step_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_step_tokens must be None or an integer >= 1, got {_show(m)}")
        if self.bucket_shapes is not None and not isinstance(self.bucket_shapes, bool):
            raise ValueError(f"bucket_shapes must be None or a bool, got {_show(self.bucket_shapes)}")
        if self.decode_path is not None and self.decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be None or one of {list(DECODE_PATHS)}, got {_show(self.decode_path)}")


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
