"""The text-generation input schema: :class:`GenerationInput` declares every key of an input dict
once (type, range and, as the ``Meta`` description, what a refusal says it must be), and
:func:`decode` turns a caller's string or dict into one, with ``msgspec.convert(strict=True)``.

A key left out, or None (JSON null) where the type allows it, takes the serving's default; the
server's field tables are derived from :data:`KEYS`. Rules between keys, or against the tokenizer
and the serving's options, are checked after decoding (``_request.parse_request``).
"""

from __future__ import annotations

import re
import sys
import typing
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ...serving import InvalidInput

from ..generation.sampling import _show

__all__ = ["KEYS", "MAX_COMPLETIONS", "MAX_LOGIT_BIAS", "MAX_STOP_TOKEN_IDS", "MAX_TOP_LOGPROBS", "GenerationInput",
           "decode"]

#: Most completions of one prompt (``n``); as many rows of the batch.
MAX_COMPLETIONS = 16
#: Most alternatives per token (``top_logprobs``), OpenAI's bound.
MAX_TOP_LOGPROBS = 20
#: Most ``logit_bias`` entries: bounds the caller-side check (~1 us each); OpenAI documents no bound.
MAX_LOGIT_BIAS = 1024
#: Most ``stop_token_ids``: bounds the caller-side check, as ``logit_bias``.
MAX_STOP_TOKEN_IDS = 1024
_FINITE = sys.float_info.max  # an upper bound that refuses inf (NaN fails every bound)
_FLAG = "true, false or null"


class GenerationInput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One text-generation input as the caller sent it (after :func:`decode`): exactly one of
    ``text`` (a plain prompt) and ``messages`` (chat; each message is checked by
    ``_request``), the others None for "the serving's default". Semantics of each key:
    docs/qwen3.md ("Request options"); the sampling keys are :class:`SamplingParams`' fields."""

    text: Annotated[str, Meta(min_length=1, description="a non-empty string")] | UnsetType = UNSET
    messages: Annotated[list[Any], Meta(min_length=1, description="a non-empty list of {'role', 'content'} "
                                        "message objects")] | UnsetType = UNSET
    max_new_tokens: Annotated[int, Meta(ge=0, description="an integer >= 1 (0 with prompt_logprobs: score the "
                                        "prompt only)")] | None = None
    temperature: Annotated[float, Meta(ge=0, le=_FINITE, description="a finite number >= 0")] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, description="a number in (0, 1]")] | None = None
    seed: Annotated[int, Meta(ge=0, description="an integer in [0, 2**64)")] | None = None  # < 2**64: SamplingParams
    top_k: Annotated[int, Meta(ge=0, description="an integer >= 0 (0 = off)")] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1, description="a finite number in [0, 1]")] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=_FINITE, description="a finite number > 0")] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2, description="a finite number in [-2, 2]")] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2, description="a finite number in [-2, 2]")] | None = None
    logit_bias: Annotated[dict[int | str, Annotated[float, Meta(ge=-100, le=100)]], Meta(
        max_length=MAX_LOGIT_BIAS, description=f"an object {{token id: bias}} of at most {MAX_LOGIT_BIAS} entries "
        "(ids ints or decimal strings, biases numbers in [-100, 100])")] | None = None
    min_tokens: Annotated[int, Meta(ge=0, description="an integer in [0, max_new_tokens]")] | None = None
    logprobs: Annotated[bool, Meta(description=_FLAG)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS,
                                      description=f"an integer in [0, {MAX_TOP_LOGPROBS}]")] | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS,
                                         description=f"an integer in [0, {MAX_TOP_LOGPROBS}]")] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_COMPLETIONS, description=f"an integer in [1, {MAX_COMPLETIONS}]")] | None = None
    response_format: Annotated[dict[str, Any], Meta(description="an object (OpenAI's response_format)")] | None = None
    priority: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1, description="an integer in [-2**63, 2**63)")] | None = None
    stop: Annotated[str | list[str], Meta(description="a string or a list of strings")] | None = None
    enable_thinking: Annotated[bool, Meta(description=_FLAG)] | None = None
    tools: Annotated[list[dict[str, Any]], Meta(description="a list of tool objects (JSON Schema function "
                                                "specs)")] | None = None
    tool_choice: Annotated[str | dict[str, Any], Meta(description="'auto', 'none', 'required' or {'type': "
                                                      "'function', 'function': {'name': str}}")] | None = None
    parallel_tool_calls: Annotated[bool, Meta(description=_FLAG)] | None = None
    ignore_eos: Annotated[bool, Meta(description=_FLAG)] | None = None
    stop_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS, description="a list of at most "
                                              f"{MAX_STOP_TOKEN_IDS} token ids")] | None = None
    include_stop_str_in_output: Annotated[bool, Meta(description=_FLAG)] | None = None
    stream_usage: Annotated[bool, Meta(description=_FLAG)] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, description="-1 or an integer >= 1")] | None = None


#: Every input key, in declaration order (the order keys are checked in).
KEYS: tuple[str, ...] = GenerationInput.__struct_fields__
_FIELD = re.compile(r"`\$\.(\w+)")  # the field in msgspec's path: "- at `$.n`", "`key` in `$.logit_bias`"


def _description(hint: object) -> str:
    """The first ``Meta`` description in a type hint, searched through ``Annotated`` and unions."""
    for meta in getattr(hint, "__metadata__", ()):
        if isinstance(meta, Meta) and meta.description:
            return meta.description
    return next((d for d in map(_description, typing.get_args(hint)) if d), "")


_MUST_BE = {k: _description(h) for k, h in typing.get_type_hints(GenerationInput, include_extras=True).items()}


def decode(item: object) -> GenerationInput:
    """``item`` (a string: ``{"text": item}``; or an input dict) as a :class:`GenerationInput`.
    Raises InvalidInput naming the key at fault, in its message ("<key> must be <description>,
    got <value>") and as its ``param``: the first in :data:`KEYS` order when several are; an
    unknown key (the smallest, cut to 80 characters); ``top_logprobs`` without ``logprobs``;
    no ``param`` for an item that is not a string or a dict with exactly one of "text" and
    "messages"."""
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise InvalidInput(f"expected a string or a dict with 'text' or 'messages', got {type(item).__name__}")
    unknown = set(item) - set(KEYS)
    if unknown:
        named = min((k[:80] for k in unknown if isinstance(k, str)), default=None)  # a key may be huge
        raise InvalidInput(f"unknown input keys {_keys(unknown)} (allowed: {sorted(KEYS)})", named)
    if ("text" in item) == ("messages" in item):
        raise InvalidInput("an input dict needs exactly one of 'text' or 'messages'")
    try:
        spec = msgspec.convert({k: item[k] for k in KEYS if k in item}, GenerationInput, strict=True)
    except msgspec.ValidationError as exc:
        found = _FIELD.search(str(exc))
        if found is None:  # not a field's error (none known): msgspec's own words
            raise InvalidInput(str(exc)) from None
        key = found[1]
        raise InvalidInput(f"{key} must be {_MUST_BE[key]}, got {_show(item[key])}", key) from None
    if spec.top_logprobs is not None and not spec.logprobs:
        raise InvalidInput("top_logprobs needs logprobs: true", "top_logprobs")
    return spec


def _keys(keys: set[Any]) -> str:
    """``['a', 'b']`` for any keys (mixed types do not sort; a key may be huge)."""
    return "[" + ", ".join(sorted(_show(k) for k in keys)[:10]) + (", ...]" if len(keys) > 10 else "]")
