"""Per-request sampling and output options of the text-generation serving, checked in the caller.

Each function reads one group of input keys of a request dict (``spec``) and raises
:class:`~mlx_serving.serving.InvalidInput` (a ValueError) naming the key, in its message and as its
``param``, for a bad value; None (JSON null) is the default. Used by ``_inputs.preprocess``;
the table of keys is in docs/qwen3.md ("Request options").
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

from ...serving import InvalidInput
from ...tokenization import Tokenizer

from ..generation.sampling import MAX_SEED, SamplingParams, _show
from ._options import GenerationOptions
from ._structured import compile_response_format, tool_call_format

__all__ = ["KEYS", "MAX_COMPLETIONS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "completion_params", "completion_seed",
           "completions", "priority", "sampling_params"]

#: Keys passed to :class:`SamplingParams` under their own name (the serving's options give the
#: defaults of those it has: max_new_tokens, temperature, top_p).
_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "min_tokens")
#: The keys SamplingParams checks, in its order (``_culprit``).
_CHECK_ORDER = (*_SAMPLING_KEYS[:-1], "logit_bias", "min_tokens")
#: Every key read here.
KEYS = (*_SAMPLING_KEYS, "logit_bias", "logprobs", "top_logprobs", "n", "response_format", "priority", "tool_choice",
        "parallel_tool_calls", "ignore_eos", "stop_token_ids", "include_stop_str_in_output")
#: Most ``stop_token_ids``: bounds the caller-side check, as ``logit_bias``.
MAX_STOP_TOKEN_IDS = 1024
#: Most completions of one prompt (``n``); as many rows of the batch.
MAX_COMPLETIONS = 16
#: Most alternatives per token (``top_logprobs``), OpenAI's bound.
MAX_TOP_LOGPROBS = 20
#: Most ``logit_bias`` entries: bounds the caller-side check (~1 us each); OpenAI documents no bound.
MAX_LOGIT_BIAS = 1024
_PRIORITY_RANGE = (-(2**63), 2**63)  # a signed 64-bit int: what an engine or a wire format holds
_MAX_ID_DIGITS = 10  # a token id written as a string: at most 2**32 - 1


def sampling_params(spec: dict[str, Any], tokenizer: Tokenizer, opts: GenerationOptions) -> SamplingParams:
    """The row's :class:`SamplingParams`: the request's keys over the serving's defaults.

    ``logit_bias``: ``{token id: bias}``, ids as ints or decimal strings (JSON object keys), each in
    ``[0, tokenizer.vocab_size)``, biases in [-100, 100], at most :data:`MAX_LOGIT_BIAS` entries.
    ``logprobs``: a bool; ``top_logprobs``: an int in [0, 20], only with ``logprobs`` true.
    ``response_format``: OpenAI's shape, compiled to a grammar (``_structured``); ``tool_choice``
    "required" or a named function (with ``tools``; ``parallel_tool_calls`` false: one call) compiles
    to the grammar of a forced call instead (:func:`~._structured.tool_call_format`).
    ``ignore_eos`` (a bool, vLLM's): the tokenizer's EOS ids do not end the row (it runs to
    ``max_new_tokens``, a stop string or a stop token); ``stop_token_ids`` (vLLM's): a list of
    ids in ``[0, vocab_size)``, at most :data:`MAX_STOP_TOKEN_IDS`, that end the row as EOS does
    (the id is the row's last token). Raises InvalidInput naming the key (its ``param``)."""
    values = {k: spec[k] if spec.get(k) is not None else getattr(opts, k, None) for k in _SAMPLING_KEYS}
    kwargs = {k: v for k, v in values.items() if v is not None}
    if spec.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(spec["logit_bias"], tokenizer.vocab_size)
    kwargs["logprobs"] = _logprobs(spec.get("logprobs"), spec.get("top_logprobs"))
    kwargs["grammar"] = _grammar(spec)
    eos = _stop_ids(spec, tokenizer)
    try:
        return SamplingParams(eos_token_ids=eos, **kwargs)
    except ValueError as exc:
        raise InvalidInput(str(exc), _culprit(kwargs)) from None


def _culprit(kwargs: dict[str, Any]) -> str | None:
    """The key of ``kwargs`` that SamplingParams refuses (after :func:`sampling_params` failed to
    build one, so the first key its message names): each key is tried alone, in the order
    SamplingParams checks them (``min_tokens`` with ``max_new_tokens``: its range depends on it);
    None if each passes alone. Runs only on the failure path."""
    for key in _CHECK_ORDER:
        if key not in kwargs:
            continue
        probe = {key: kwargs[key]}
        if key == "min_tokens" and "max_new_tokens" in kwargs:
            probe["max_new_tokens"] = kwargs["max_new_tokens"]
        try:
            SamplingParams(**probe)
        except ValueError:
            return key
    return None


def _stop_ids(spec: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end the row: the tokenizer's EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    ignore = spec.get("ignore_eos")
    if ignore is not None and not isinstance(ignore, bool):
        raise InvalidInput(f"ignore_eos must be true, false or null, got {_show(ignore)}", "ignore_eos")
    ids = set() if ignore else set(tokenizer.eos_token_ids)
    extra = spec.get("stop_token_ids")
    if extra is not None:
        if not isinstance(extra, (list, tuple)) or len(extra) > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got "
                               f"{_show(extra)}", "stop_token_ids")
        for i in extra:
            if not _is_int(i) or not 0 <= i < tokenizer.vocab_size:
                raise InvalidInput(f"stop_token_ids: {_show(i)} is not a token id in [0, {tokenizer.vocab_size})",
                                   "stop_token_ids")
        ids |= {int(i) for i in extra}
    return tuple(sorted(ids))


def _grammar(spec: dict[str, Any]) -> str | None:
    """The grammar of the request's ``response_format``, or of the one its ``tool_choice`` forces."""
    choice, parallel = spec.get("tool_choice"), spec.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInput(f"parallel_tool_calls must be true, false or null, got {_show(parallel)}",
                           "parallel_tool_calls")
    if choice in (None, "auto", "none"):
        return compile_response_format(spec.get("response_format"))
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise InvalidInput(f"tool_choice {_show(choice)} needs 'tools' (a non-empty list of tool dicts)",
                           "tool_choice")
    if spec.get("response_format") is not None:
        raise InvalidInput("tool_choice 'required' or a named function forces the output's format: it cannot be "
                           "combined with response_format", "tool_choice")
    forced = tool_call_format(tools, choice, parallel is not False)
    try:
        return compile_response_format(forced)
    except ValueError as exc:
        raise InvalidInput(f"tools: a function's parameters schema cannot be compiled for tool_choice: {exc}",
                           "tools") from None


def completions(spec: dict[str, Any]) -> int:
    """``n``: how many completions of this prompt, an int in [1, 16] (default 1)."""
    n = spec.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_COMPLETIONS:
        raise InvalidInput(f"n must be an integer in [1, {MAX_COMPLETIONS}], got {_show(n)}", "n")
    return int(n)


def priority(spec: dict[str, Any]) -> int:
    """``priority``: an int in [-2**63, 2**63) (default 0; lower runs sooner under the "priority"
    scheduling policy, as in vLLM)."""
    value = spec.get("priority")
    if value is None:
        return 0
    if not _is_int(value) or not _PRIORITY_RANGE[0] <= value < _PRIORITY_RANGE[1]:
        raise InvalidInput(f"priority must be an integer in [-2**63, 2**63), got {_show(value)}", "priority")
    return int(value)


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request with ``seed`` and ``n > 1``: the first 64-bit
    word of ``numpy.random.SeedSequence([seed, index])`` (distinct streams per completion and per
    seed, unlike ``seed + index``). An int in [0, 2**64)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]) % MAX_SEED


def completion_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per completion: ``params`` itself when ``n == 1``; else a seeded request
    gets :func:`completion_seed` per completion, an unseeded one fresh entropy per row."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=completion_seed(params.seed, i)) for i in range(n)]


def _logprobs(logprobs: Any, top: Any) -> int | None:
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidInput(f"logprobs must be true, false or null, got {_show(logprobs)}", "logprobs")
    if top is None:
        return 0 if logprobs else None
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_show(top)}",
                           "top_logprobs")
    if not logprobs:
        raise InvalidInput("top_logprobs needs logprobs: true", "top_logprobs")
    return int(top)


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """``{id or decimal string: bias}`` -> ``{id: bias}`` (biases are checked by SamplingParams)."""
    if not isinstance(value, dict):
        raise InvalidInput(f"logit_bias must be an object {{token id: bias}}, got {_show(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidInput(f"logit_bias has {len(value):,} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidInput(f"logit_bias keys must be token ids in [0, {vocab_size}) (ints or decimal strings), "
                               f"got {_show(key)}", "logit_bias")
        if token in out:
            raise InvalidInput(f"logit_bias names token {token} twice", "logit_bias")
        out[token] = bias
    return out


def _token_id(key: Any) -> int | None:
    if _is_int(key):
        return int(key)
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= _MAX_ID_DIGITS:
        return int(key)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
