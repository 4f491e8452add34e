"""Client preprocessing: parse, validate and tokenize text-generation inputs (caller side)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...serving import Batch
from ...tokenization import Tokenizer

from ..qwen3.sampling import SamplingParams
from ._options import GenerationOptions, _stop_tuple

__all__ = ["Prompt", "RequestInfo", "needs_thread", "preprocess"]

_OPTION_KEYS = ("max_new_tokens", "temperature", "top_p", "seed")
_KEYS = frozenset(("text", "messages", "stop", "enable_thinking", "tools", *_OPTION_KEYS))

# Preprocessing of an input above this size may hold an event loop for more than ~10 ms, so
# async callers run it on a worker thread (needs_thread). Size: characters of every string in
# the input, plus _CONTAINER_CHARS per dict or list (a message, a tool, the input list).
# Measured on the 2-core dev machine, Qwen3 tokenizer, best of 5 (python -m timeit -s "from
# mlx_serving.tokenization import Tokenizer; t = Tokenizer.qwen3(); import random; r =
# random.Random(0); s = ''.join(r.choice('0123456789') for _ in range(10_000))" "t.encode(s)"):
# 10,000 random digits 13.9 ms (the slowest text found: ~7,200 chars per 10 ms), random CJK
# 11.0 ms, random emoji 11.0 ms, English prose (docs/qwen3.md) 5.2 ms (~19,000 chars per 10 ms);
# encode_chat of one short message 0.11 ms, of 200 one-character messages 6.7 ms (34 us per
# message), of one message + 5 tools (~800 chars of JSON) 1.1 ms. 3,000 chars is ~4 ms of the
# slowest text: a 2x margin under 10 ms for a loaded machine.
_OFFLOAD_CHARS = 3_000
_CONTAINER_CHARS = 50
_END = object()


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


def needs_thread(input: Any) -> bool:
    """True when preprocessing ``input`` (tokenization, chat templating) could take more than
    ~10 ms: its strings (text, message contents, tools; for a list input, all items together)
    hold more than 3,000 characters, each dict or list counting as 50 more. Never raises; stops
    walking the input as soon as the budget is spent, so its own cost is bounded."""
    budget = _OFFLOAD_CHARS
    stack = [iter((input,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        if isinstance(item, str):
            budget -= len(item) + 1
        elif isinstance(item, (dict, list, tuple)):
            budget -= _CONTAINER_CHARS
            stack.append(iter(item.values() if isinstance(item, dict) else item))
        else:
            budget -= 1
        if budget < 0:
            return True
    return False


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
