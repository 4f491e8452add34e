"""The Responses request fields whose shape differs on the chat path, each mapped to its chat field.

Flat function ``tools`` -> chat tools (:func:`tools`); ``tool_choice`` (:func:`tool_choice`);
``text.format`` -> ``response_format`` (:func:`response_format`); ``reasoning.effort`` ->
``chat_template_kwargs.enable_thinking`` (:func:`thinking`: "none" off, any other effort on);
``include: ["message.output_text.logprobs"]`` / ``top_logprobs`` -> logprobs (:func:`logprobs`).
Each returns None where the chat path's default applies, and raises :class:`~.._errors.APIError`
400 naming the Responses field for a value it cannot honour (built-in tools, ``allowed_tools``,
``text.verbosity``, reasoning summaries, ...).
"""

from __future__ import annotations

from ...serving._json import JSON
from .._errors import APIError
from ._items import Json

__all__ = ["logprobs", "response_format", "thinking", "tool_choice", "tools"]

_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_LOGPROBS = "message.output_text.logprobs"


def tools(value: JSON) -> list[Json] | None:
    """Flat function tools -> chat tools; APIError 400 (param ``tools``) for any other kind."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise APIError(400, "'tools' must be a list of function tools", param="tools")
    out: list[Json] = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool, dict):  # not a dict: kind is None
            raise APIError(400, f"tools[{i}]: only function tools are supported, not {kind!r:.80} (built-in tools "
                           "run on OpenAI's servers)", param="tools")
        fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'name', 'description', 'parameters', "
                           "'strict'}" + (f", not {unknown[0]!r:.80}" if unknown else ""), param="tools")
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(choice: JSON) -> JSON:
    """``tool_choice`` in the chat shape (None for "auto", the default); APIError 400 for hosted
    tools and ``allowed_tools``."""
    if choice in (None, "auto"):
        return None
    if choice in ("none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                   param="tool_choice")


def response_format(text: JSON) -> Json | None:
    """``text.format`` -> the chat ``response_format`` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise APIError(400, "'text' may hold only 'format' (and a null 'verbosity')", param="text")
    if text.get("verbosity") is not None:
        raise APIError(400, "'text.verbosity' is not supported by this server", param="text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict):  # a kind means fmt is a dict
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise APIError(400, "'text.format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", param="text")


def thinking(reasoning: JSON) -> Json | None:
    """``reasoning`` -> ``chat_template_kwargs`` (effort "none": thinking off; any other: on)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise APIError(400, "'reasoning' may hold only 'effort'", param="reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise APIError(400, f"'reasoning.{key}' is not supported: the reasoning comes back whole, as the "
                           "reasoning item's content", param=f"reasoning.{key}")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in _EFFORTS:
        raise APIError(400, f"'reasoning.effort' must be one of {list(_EFFORTS)}, got {effort!r:.80}",
                       param="reasoning.effort")
    return {"enable_thinking": effort != "none"}


def logprobs(body: Json) -> bool:
    """Whether the output text carries logprobs (``include`` names them, or ``top_logprobs`` is set)."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != _LOGPROBS for x in include):
        raise APIError(400, f"'include' may hold only {_LOGPROBS!r}", param="include")
    return bool(include) or body.get("top_logprobs") is not None
