"""Text generation as a Serving: Qwen3 (MLX) with continuous batching, streaming and stop strings.

Input (one request): a string, ``{"text": str}``, ``{"messages": [...]}`` (chat template applied),
optionally with per-request ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``enable_thinking``, ``tools``; or a list of these. Output for one input:
``{"results": [{"generated_text", "num_tokens", "finish_reason", "token_summary": {"input",
"output"}, "timing"}]}``; a list input returns a list of those, in order. ``finish_reason`` is
"stop" (EOS or a stop string) or "length" (max_new_tokens), the values of :class:`FinishReason`.

Sampling (as in mlx-lm and the OpenAI API): ``temperature`` 0 (the default; anything below 1e-5
too) is greedy decoding; a larger one samples at that temperature from the ``top_p`` nucleus
(default 1.0: plain temperature sampling), reproducibly when ``seed`` (an int in [0, 2**64)) is
given. Types and ranges of every option: ``_inputs.preprocess`` and docs/qwen3.md.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from ...serving import Serving
from ...tokenization import Tokenizer

from ..qwen3 import FinishReason, State, load
from ..generation.slot_cache import budget_slots
from ._backend import GenerationBackend
from ._events import TokenEvent
from ._inputs import RequestInfo, max_bytes_per_token, needs_thread, preprocess
from ._options import GenerationOptions
from ._stream import GenerationTransducer, collect

__all__ = ["FinishReason", "GenerationOptions", "TokenEvent", "from_mlx4bit", "serving"]

_BATCH_TIMEOUT_S = 0.005  # admission window when idle: short, generation requests are long


def serving(tokenizer: Tokenizer, state: State, **options: Any) -> Serving:
    """A text-generation Serving over a loaded Qwen3 ``state``.

    ``options`` are the fields of :class:`GenerationOptions` (max_new_tokens=100, max_len=2048,
    temperature=0.0, top_p=1.0, chat=False, stop=(), profile_timing=True, max_batch=32,
    prefill_chunk=512, kv_cache_bytes=None). ``Serving.start`` defaults to
    ``batch_size=max_batch`` and a 5 ms admission window. The tokenizer's byte table (streaming
    detokenization) is built here, once per tokenizer, not inside a caller's first request; async
    callers tokenize a long input (more than ~3,000 characters, see ``_inputs.needs_thread``) on
    a worker thread, so no client-side step holds their event loop for more than ~10 ms.
    Raises ValueError for a bad option (including a ``kv_cache_bytes`` that holds no sequence of
    ``max_len``), TypeError for an unknown one, and TokenizationError (a ValueError) for a
    tokenizer whose decoder is not byte-level. Bad inputs raise ValueError in the caller only
    (every per-request option is checked there: ``_inputs.preprocess``), and a prompt too long
    for ``max_len`` whatever its tokenization (more UTF-8 bytes than ``max_len`` times the
    tokenizer's longest token, x3 for NFC; see ``_inputs.max_bytes_per_token``) is refused before
    it is tokenized.
    """
    opts = GenerationOptions(**options)
    _check_budget(state, opts)
    tokenizer.byte_table()  # built once per tokenizer and cached (0.1-0.35 s for Qwen3)
    per_token = max_bytes_per_token(tokenizer)  # prompts longer than this x max_len never fit
    return (
        Serving.new(GenerationBackend(state, opts))
        .client_preprocessing(lambda input: preprocess(input, tokenizer, opts, per_token), offload=needs_thread)
        .streaming(lambda info: GenerationTransducer(tokenizer, info, opts.profile_timing))
        .client_postprocessing(_postprocess)
        .process_options(batch_size=opts.max_batch * (2 if opts.policy == "priority" else 1),
                         batch_timeout=_BATCH_TIMEOUT_S)
    )


def from_mlx4bit(path: str | Path, tokenizer: Tokenizer | None = None, *, dequantize: bool = False,
                 **options: Any) -> Serving:
    """Load an MLX checkpoint directory (4-bit or dense) and return :func:`serving` over it.

    The tokenizer comes from the same directory unless given. ``dequantize``: keep the
    projections as dense matrices (more memory, faster batched decode on a GPU; see
    ``models.qwen3.load``). Raises FileNotFoundError naming a missing file, ValueError for an
    unsupported checkpoint or option.
    """
    from ..registry import load as load_family  # the family by config.json's model_type (qwen3, llama, ...)

    _check_option_names(options)
    state = load_family(path, dequantize=dequantize)
    return serving(tokenizer or Tokenizer.from_dir(path), state, **options)


def _check_option_names(options: dict[str, Any]) -> None:
    known = {f.name for f in fields(GenerationOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown text-generation options {unknown} (known: {sorted(known)})")


def _check_budget(state: State, opts: GenerationOptions) -> None:
    """ValueError unless the KV budget holds at least one sequence of ``max_len``."""
    if opts.kv_cache_bytes is not None:
        budget_slots(state, opts.max_len, opts.kv_cache_bytes)


def _postprocess(result: tuple[list[Any], Any], info: RequestInfo) -> Any:
    items, _metadata = result
    return collect(items, info)
