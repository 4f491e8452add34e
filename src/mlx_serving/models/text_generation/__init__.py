"""Text generation as a Serving: MLX models (Qwen3, Llama, Mistral), continuous batching, streaming, stop strings.

Input (one request): a string, ``{"text": str}``, ``{"messages": [...]}`` (chat template applied),
optionally with per-request options (OpenAI / vLLM names: the fields of
``_schema.GenerationInput``, the one place they are declared); or a list of these. Output for one input: ``{"results": [...]}`` with one entry per completion (``n``), each
``{"generated_text", "num_tokens", "finish_reason", "token_summary": {"input", "output", "cached"},
"timing"}`` plus ``logprobs`` (when asked for), ``prompt_logprobs`` (asked for: the prompt's
tokens' log-probabilities; ``max_new_tokens`` 0 then scores the prompt only), ``reasoning_content`` (``enable_thinking`` true and
the output thought) and ``tool_calls`` (``tools`` given and called); a list input returns a list
of those, in order. ``finish_reason`` is "stop" (EOS, a stop string or a complete
``response_format``), "length" (max_new_tokens) or "tool_calls", values of :class:`FinishReason`.

Sampling (as in mlx-lm and the OpenAI API): ``temperature`` 0 (the default; anything below 1e-5
too) is greedy decoding; a larger one samples at that temperature (after top-k, top-p, min-p),
reproducibly when ``seed`` (an int in [0, 2**64)) is given. Types, ranges and defaults of every
option: ``_schema.GenerationInput`` and docs/qwen3.md ("Request options").
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from ...serving import Batch, Serving
from ...serving._json import JSON, JSONObject
from ...tokenization import Tokenizer

from ..generation.events import FinishReason
from ..decoder.layers import State
from ..decoder.kv_cache import plan_blocks
from ._backend import GenerationBackend
from ._events import TokenEvent
from ._inputs import RequestInfo, max_bytes_per_token, needs_thread, preprocess
from ._options import GenerationOptions
from ._stream import GenerationTransducer, collect
from ._structured import GrammarConstraint, GrammarFactory, constraint_factory

__all__ = ["FinishReason", "GenerationOptions", "TokenEvent", "from_mlx4bit", "from_pretrained", "serving"]

_BATCH_TIMEOUT_S = 0.005  # admission window when idle: short, generation requests are long


def serving(tokenizer: Tokenizer, state: State, **options: Any) -> Serving:
    """A text-generation Serving over a loaded model ``state`` (any family of ``models.families``
    loads: Qwen3, Qwen2, Llama, Mistral).

    ``options`` are the fields of :class:`GenerationOptions` (max_new_tokens=None: 100, at most
    half of max_len, capped per request to what the prompt leaves; max_len=2048,
    temperature=0.0, top_p=1.0, chat=False, stop=(), profile_timing=True, max_batch=32,
    prefill_chunk=512, kv_cache_bytes=None, kv_cache_fraction=None, prefix_caching=True,
    policy="fcfs", max_step_tokens=None: 2,048 where shapes are bucketed, 512 on the CPU, bucket_shapes=None: on
    a GPU, and then every shape is built before ``Serving.start`` returns, block_size=16,
    buffer_cache_bytes=0 on the CPU, 1 GiB on a GPU, kv_cache_dtype="auto" ("int8", "int4": a quantized KV cache), decode_path=None (the native CPU decode step where it applies, int8-activation products;
    "matmul": the exact path), compile_decode=None, pack_prefill=None,
    max_causal_groups=4; the engine fields make its one ``EngineConfig``; typed Any: callers forward them by name at run time and
    :class:`GenerationOptions` checks each). ``Serving.start`` defaults to ``batch_size=max_batch``
    (under either policy) and a 5 ms admission window; the serving hands every queued request to the engine's scheduler (the
    backend's ``waiting``), which holds the one queue and orders it by ``policy``. The tokenizer's
    byte table (streaming detokenization) is built here, once per tokenizer, not inside a caller's
    first request; async callers tokenize a long input (more than ~3,000 characters, see
    ``_inputs.needs_thread``) on a worker thread, so no client-side step holds their event loop for
    more than ~10 ms.
    Raises ValueError for a bad option (including a ``kv_cache_bytes`` that holds no sequence of
    ``max_len``), TypeError for an unknown one, and TokenizationError (a ValueError) for a
    tokenizer whose decoder is not byte-level. Bad inputs raise ValueError in the caller only
    (every per-request option is checked there: ``_inputs.preprocess``), and a prompt too long
    for ``max_len`` whatever its tokenization (more UTF-8 bytes than ``max_len`` times the
    tokenizer's longest token, x3 for NFC; see ``_inputs.max_bytes_per_token``) is refused before
    it is tokenized. A ``response_format`` is compiled in the caller; the engine's llguidance
    constraint factory is built on the first constrained sequence (``_LazyConstraints``).
    """
    opts = GenerationOptions(**options)
    _check_budget(state, opts)
    _check_draft(opts)
    tokenizer.byte_table()  # built once per tokenizer and cached (0.1-0.35 s for Qwen3)
    per_token = max_bytes_per_token(tokenizer)  # prompts longer than this x max_len never fit
    constraints = _LazyConstraints(tokenizer, state.config.vocab_size)

    def pre(input: JSON) -> tuple[Batch, RequestInfo]:
        return preprocess(input, tokenizer, opts, per_token)

    return (
        Serving.new(GenerationBackend(state, opts, constraint_factory=constraints))
        .client_preprocessing(pre, offload=needs_thread)
        .streaming(lambda info: GenerationTransducer(tokenizer, info, opts.profile_timing))
        .client_postprocessing(_postprocess)
        .process_options(batch_size=opts.max_batch, batch_timeout=_BATCH_TIMEOUT_S)
    )


def from_mlx4bit(path: str | Path, tokenizer: Tokenizer | None = None, *, dequantize: bool = False,
                 **options: object) -> Serving:
    """Load an MLX checkpoint directory (4-bit or dense) and return :func:`serving` over it.

    The tokenizer comes from the same directory unless given. ``dequantize``: keep the
    projections as dense matrices (more memory, faster batched decode on a GPU; see
    ``models.loader.load``). Raises FileNotFoundError naming a missing file, ValueError for an
    unsupported checkpoint or option.
    """
    from ..loader import load as load_family  # the family by config.json's model_type (qwen3, llama, ...)

    _check_option_names(options)
    state = load_family(path, dequantize=dequantize)
    return serving(tokenizer or Tokenizer.from_dir(path), state, **options)


def from_pretrained(model: str | Path | None = None, tokenizer: Tokenizer | None = None, *,
                    dequantize: bool = False, **options: object) -> Serving:
    """:func:`from_mlx4bit` over any model source (``models.sources.resolve``): None for the
    default model (SmolLM2-135M-Instruct, fetched and converted on first use), a checkpoint
    directory, a ``.gguf`` file, a Hugging Face repo id ``org/name[@revision]``, a packaged
    model's name or ``seeded:<family>-<preset>``. Raises what ``resolve`` and
    :func:`from_mlx4bit` raise (ValueError subclasses naming the model, FetchError an OSError)."""
    from ..sources import resolve

    return from_mlx4bit(resolve(model).path, tokenizer, dequantize=dequantize, **options)


def _check_option_names(options: dict[str, object]) -> None:
    known = {f.name for f in fields(GenerationOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown text-generation options {unknown} (known: {sorted(known)})")


def _check_budget(state: State, opts: GenerationOptions) -> None:
    """ValueError unless the KV budget holds at least one sequence of ``max_len``."""
    cache = opts.engine.cache
    if cache.kv_cache_bytes is not None:
        plan_blocks(state, 1, cache.max_len, cache.kv_cache_bytes, block_size=cache.block_size,
                    kv_cache_dtype=cache.kv_cache_dtype)


def _check_draft(opts: GenerationOptions) -> None:
    """A "draft_model" speculative config's model must resolve here, in the caller (the engine
    loads it on the executor thread, where a failure would reach the first request as a
    BackendError). Raises DraftModelError (a ValueError naming ``speculative_config.model``)."""
    spec = opts.engine.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return
    from ..generation.spec_decode.draft import DraftModelError
    from ..sources import resolve

    try:
        resolve(spec.model)
    except (OSError, ValueError) as e:
        raise DraftModelError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e


class _LazyConstraints:
    """The engine's constraint factory (``_structured.constraint_factory``), built on the first
    sequence with a ``response_format``: llguidance's tokenizer costs ~0.6 s once per tokenizer and
    llguidance is an optional extra, so a serving that never gets a format pays nothing. Called on
    the executor thread only (``Engine.add``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._factory: GrammarFactory | None = None

    def __call__(self, grammar: str, eos_token_ids: tuple[int, ...]) -> GrammarConstraint:
        if self._factory is None:
            self._factory = constraint_factory(self._tokenizer, self._vocab_size)
        return self._factory(grammar, eos_token_ids)


def _postprocess(result: tuple[list[Any], Any], info: RequestInfo) -> JSONObject | list[JSONObject]:
    items, _metadata = result
    return collect(items, info)
