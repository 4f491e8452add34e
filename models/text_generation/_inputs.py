"""Client preprocessing: parse, validate and tokenize text-generation inputs (caller side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...serving import Batch
from ...tokenization import Tokenizer

from ..qwen3.sampling import SamplingParams
from ._options import GenerationOptions, _stop_tuple

__all__ = ["Prompt", "RequestInfo", "preprocess"]

_OPTION_KEYS = ("max_new_tokens", "temperature", "top_p", "seed")
_KEYS = frozenset(("text", "messages", "stop", "enable_thinking", "tools", *_OPTION_KEYS))


@dataclass(frozen=True)
class Prompt:
    """One row sent to the executor: token ids (int32 range) and sampling parameters."""

    ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class RequestInfo:
    """Caller-side facts about one request: whether the input was a list, each row's prompt
    length (tokens) and stop strings."""

    is_list: bool
    input_tokens: tuple[int, ...]
    stops: tuple[tuple[str, ...], ...]


def preprocess(input: Any, tokenizer: Tokenizer, opts: GenerationOptions) -> tuple[Batch, RequestInfo]:
    """Turn an input (a string, ``{"text": ...}``, ``{"messages": [...]}`` or a list of them) into a
    Batch of :class:`Prompt` rows. Raises ValueError (naming the item for lists) for an empty
    input, an unknown key, a bad option, or a prompt + max_new_tokens longer than max_len."""
    is_list = isinstance(input, list)
    items = input if is_list else [input]
    if not items:
        raise ValueError("empty input list: give at least one prompt")
    rows, stops = [], []
    for i, item in enumerate(items):
        try:
            prompt, stop = _one(item, tokenizer, opts)
        except ValueError as e:
            raise ValueError(f"input {i}: {e}" if is_list else str(e)) from None
        rows.append(prompt)
        stops.append(stop)
    info = RequestInfo(is_list, tuple(len(p.ids) for p in rows), tuple(stops))
    return Batch.stack(rows), info


def _one(item: Any, tokenizer: Tokenizer, opts: GenerationOptions) -> tuple[Prompt, tuple[str, ...]]:
    spec = _as_dict(item)
    ids = _tokenize(spec, tokenizer, opts)
    options = {k: spec.get(k, getattr(opts, k, None)) for k in _OPTION_KEYS}
    params = SamplingParams(eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)), **options)
    if len(ids) + params.max_new_tokens > opts.max_len:
        raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} = "
                         f"{len(ids) + params.max_new_tokens} exceeds max_len {opts.max_len}")
    stop = _stop_tuple(spec["stop"]) if "stop" in spec else opts.stop
    return Prompt(ids, params), stop


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"text": item}
    if not isinstance(item, dict):
        raise ValueError(f"expected a string or a dict with 'text' or 'messages', got {type(item).__name__}")
    unknown = set(item) - _KEYS
    if unknown:
        raise ValueError(f"unknown input keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
    if ("text" in item) == ("messages" in item):
        raise ValueError("an input dict needs exactly one of 'text' or 'messages'")
    return item


def _tokenize(spec: dict[str, Any], tokenizer: Tokenizer, opts: GenerationOptions) -> list[int]:
    if "messages" in spec or opts.chat:
        messages = spec.get("messages")
        if messages is None:
            messages = [{"role": "user", "content": _text(spec["text"])}]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {'role', 'content'} dicts")
        return tokenizer.encode_chat(messages, add_generation_prompt=True,
                                     enable_thinking=spec.get("enable_thinking"), tools=spec.get("tools"))
    return tokenizer.encode(_text(spec["text"]))


def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"'text' must be a string, got {type(text).__name__}")
    if not text:
        raise ValueError("empty prompt: 'text' must contain at least one character")
    return text
