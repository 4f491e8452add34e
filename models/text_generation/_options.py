"""``GenerationOptions``: serving-wide defaults of the text-generation serving."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..qwen3.sampling import SamplingParams

__all__ = ["GenerationOptions"]


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
    stop: stop strings; generation ends when the text contains one (it is not returned).
    profile_timing: add per-request ``timing`` (ms) to results and final stream events.
    max_batch: most sequences decoding at once (KV-cache slots); also the default
      ``batch_size`` of ``Serving.start``.
    prefill_chunk: prompt tokens per sequence per engine step (chunked prefill).
    kv_cache_bytes: optional cap on the KV cache; fewer slots when it binds.

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


def _stop_tuple(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)  # type: ignore[arg-type]
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    return items

