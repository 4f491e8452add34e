"""A ``POST /v1/responses`` body mapped onto the chat path: :func:`turn` -> :class:`Turn`.

The body is checked against the field tables below (a field no table names is refused; so is one
this server cannot honour: ``background``, ``conversation``, ...), its conversation built
(``instructions``, the stored turns of ``previous_response_id``, then ``input``) and rewritten as a
chat-completions body for :func:`~.._requests.chat_call` (``max_output_tokens`` -> ``max_tokens``,
the fields of :mod:`._fields`, this server's chat extensions as they are). Every error is
:class:`~.._errors.APIError` 400 naming the Responses field (:func:`renamed` maps the chat path's
names back).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import APIError, from_exception
from .._requests import GUIDED, PASS, Call, chat_call
from . import _fields
from ._items import Item, Json, items_of, messages_of
from ._store import ResponseStore

__all__ = ["Turn", "renamed", "turn"]

# Responses fields read here, by name.
_READ = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
         "parallel_tool_calls", "text", "reasoning", "stream", "stream_options", "store", "previous_response_id",
         "include", "top_logprobs", "truncation", "metadata")
# Accepted without effect on the output (OpenAI's bookkeeping; max_tool_calls bounds built-in tools only).
_IGNORED = ("user", "service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_retention",
            "max_tool_calls")
# Not honoured: 400 naming the field unless null (or false).
_UNSUPPORTED = ("background", "conversation", "prompt", "context_management", "moderation", "image",
                "access_programs", "background_options", "prompt_cache_options")
# This server's (and vLLM's) extensions of the chat path, passed to it under the same names.
_EXTENSIONS = (*(k for k in PASS if k not in _READ), "deadline", *GUIDED)
_KNOWN = frozenset((*_READ, *_IGNORED, *_UNSUPPORTED, *_EXTENSIONS))
# The chat field an error names -> the Responses field it came from.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
           "chat_template_kwargs": "reasoning", "logprobs": "include"}


@dataclass(frozen=True)
class Turn:
    """One Responses request, mapped: ``call`` (the chat path's), ``items`` (the conversation so
    far: the previous response's, then this input), ``echo`` (the request fields a response object
    repeats), ``store``, ``logprobs`` (the output text carries them)."""

    call: Call
    items: list[Item]
    echo: Json
    store: bool
    logprobs: bool


def turn(body: Json, store: ResponseStore) -> Turn:
    """Map a ``POST /v1/responses`` body (see the module docstring), continuing a response of
    ``store``. Raises APIError 400 naming the Responses field at fault (``previous_response_id``
    when that response is not stored)."""
    _check_fields(body)
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise APIError(400, f"'store' must be true, false or null, got {body['store']!r:.80}", param="store")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "'instructions' must be a string", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise APIError(400, "'previous_response_id' must be a string", param="previous_response_id")
    items = (store.items(previous) if previous else []) + items_of(body.get("input"))
    logprobs = _fields.logprobs(body)
    try:
        call = chat_call(_chat_body(body, messages_of(items, instructions), logprobs))
    except APIError as exc:
        raise renamed(exc) from None
    return Turn(call, items, _echo(body), body.get("store") is not False, logprobs)


def renamed(exc: BaseException) -> APIError:
    """The error of a chat field as the Responses field it came from (``max_tokens`` ->
    ``max_output_tokens``, ...)."""
    error = from_exception(exc)
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
    return error


def _check_fields(body: Json) -> None:
    unknown = [k for k in body if k not in _KNOWN]
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r:.80} in a responses request", param=str(unknown[0])[:80])
    for name in _UNSUPPORTED:
        if body.get(name) is not None and body[name] is not False:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, "'truncation' must be 'disabled' (a prompt that does not fit is refused, never cut)",
                       param="truncation")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise APIError(400, "'metadata' must be an object", param="metadata")
    options = body.get("stream_options")
    if options is not None and (body.get("stream") is not True or not isinstance(options, dict)
                                or set(options) - {"include_obfuscation"}):
        raise APIError(400, "'stream_options' may hold only 'include_obfuscation', with 'stream': true",
                       param="stream_options")


def _chat_body(body: Json, messages: list[Json], logprobs: bool) -> Json:
    chat: Json = {"messages": messages, "stream": body.get("stream"), "max_tokens": body.get("max_output_tokens"),
                  "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                  "tools": _fields.tools(body.get("tools")),
                  "tool_choice": _fields.tool_choice(body.get("tool_choice")),
                  "parallel_tool_calls": body.get("parallel_tool_calls"),
                  "response_format": _fields.response_format(body.get("text")),
                  "chat_template_kwargs": _fields.thinking(body.get("reasoning")),
                  "logprobs": logprobs or None, "top_logprobs": body.get("top_logprobs") if logprobs else None,
                  **{k: body.get(k) for k in _EXTENSIONS}}
    return {k: v for k, v in chat.items() if v is not None}


def _echo(body: Json) -> Json:
    """The request fields a response object repeats (OpenAI's defaults where none was given); call
    after the fields were checked."""
    same = ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_logprobs", "top_p",
            "user")
    return {**{k: body.get(k) for k in same}, "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "store": body.get("store") is not False, "text": {"format": (body.get("text") or {}).get("format")
                                                                         or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": "disabled"}
