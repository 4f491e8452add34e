"""Serving results -> the Messages API's ``message`` object, and its errors' shape.

A message is ``{"id": "msg_<hex>", "type": "message", "role": "assistant", "content": [block, ...],
"model", "stop_reason", "stop_sequence", "usage": {"input_tokens", "output_tokens"}}``; its blocks
are a ``thinking`` block (the reasoning, ``signature`` ""), a ``text`` block and ``tool_use`` blocks
(``id`` "toolu_<hex>", ``name``, ``input``: the arguments as an object); an empty text block when
there is none of those. ``stop_reason``: "end_turn", "max_tokens", "tool_use" or
"stop_sequence" (``stop_sequence`` then names it: the text ends with it, as the request keeps stop
strings in the output, and it is cut here). ``input_tokens`` counts the whole prompt (cached or not).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ...serving import InvalidInput
from .._errors import APIError, from_exception
from .._responses import Entry, Result
from ._schema import Json

__all__ = ["cut_stop", "error", "error_body", "message", "new_id", "stop_reason", "tool_use"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# The text-generation input keys the Messages API spells otherwise (see _request).
_NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "enable_thinking": "thinking",
          "response_format": "output_config"}
# Anthropic's error types by HTTP status; any other status is an "api_error".
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
                503: "overloaded_error"}


def new_id(prefix: str) -> str:
    """``msg_<hex>`` or ``toolu_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    """Anthropic's ``stop_reason`` for a serving ``finish_reason`` ("stop_sequence" when one matched)."""
    if stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def cut_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """``text`` without the stop sequence it ends with, and that sequence (the longest that fits; the
    output ends at the first match, so only a match can end it), or ``(text, None)``."""
    ends = [s for s in stops if text.endswith(s)]
    if not ends:
        return text, None
    stop = max(ends, key=len)
    return text[: len(text) - len(stop)], stop


def tool_use(call: dict[str, Any]) -> Json:
    """A ``tool_use`` block for the serving's tool call (OpenAI's ``{"id", "function": {"name",
    "arguments"}}``, the arguments a JSON object's text)."""
    return {"type": "tool_use", "id": new_id("toolu"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def message(result: Result, model: str, stops: tuple[str, ...]) -> Json:
    """The ``message`` object of a finished (non-list, n 1) text-generation result."""
    entry: Entry = result["results"][0]
    text, stop = cut_stop(entry["generated_text"], stops) if entry["finish_reason"] == "stop" else (
        entry["generated_text"], None)
    content: list[Json] = []
    if entry.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": entry["reasoning_content"], "signature": ""})
    calls = [tool_use(c) for c in entry.get("tool_calls", [])]
    if text or not (content or calls):
        content.append({"type": "text", "text": text})
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "content": content + calls,
            "model": model, "stop_reason": stop_reason(entry["finish_reason"], stop), "stop_sequence": stop,
            "usage": {"input_tokens": entry["token_summary"]["input"], "output_tokens": entry["num_tokens"]}}


def error(exc: BaseException) -> APIError:
    """The error for ``exc`` (as :func:`~.._errors.from_exception`), a serving input key named as
    the Messages API names it (``max_new_tokens`` -> ``max_tokens``, ``stop`` -> ``stop_sequences``)."""
    if isinstance(exc, InvalidInput) and exc.param in _NAMES:
        name = _NAMES[exc.param]
        return APIError(400, re.sub(rf"\b{re.escape(exc.param)}\b", name, str(exc)), param=name)
    return from_exception(exc)


def error_body(error: APIError) -> Json:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}
