"""The Messages API's request bodies as msgspec Structs (each field named once, here) and
:func:`decode`, which checks a parsed JSON body against one.

Shapes follow Anthropic's API reference (``POST /v1/messages``, ``POST /v1/messages/count_tokens``):
content blocks are tagged by ``type`` (text, image, document, tool_use, tool_result, thinking,
redacted_thinking); tools are custom tools (``name``, ``description``, ``input_schema``);
``tool_choice`` is auto / any / tool / none. ``cache_control``, ``citations``, ``metadata``,
``service_tier`` and ``output_config.effort`` are accepted where Anthropic allows them and have no
effect. A field no Struct names is refused.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec

from .._errors import APIError

__all__ = ["CountTokensRequest", "DocumentBlock", "ImageBlock", "Message", "MessagesRequest", "TextBlock",
           "ThinkingBlock", "Tool", "ToolChoice", "ToolChoiceAny", "ToolChoiceAuto", "ToolChoiceNone",
           "ToolChoiceTool", "ToolResultBlock", "ToolUseBlock", "OutputConfig", "RedactedThinkingBlock", "Thinking",
           "decode"]

Json = dict[str, Any]


class _Struct(msgspec.Struct, forbid_unknown_fields=True, tag_field="type"):
    """A block or choice: tagged by ``type``, unknown fields refused."""


class TextBlock(_Struct, tag="text"):
    text: str
    cache_control: Json | None = None
    citations: list[Json] | None = None


class ImageBlock(_Struct, tag="image"):
    source: Json
    cache_control: Json | None = None


class DocumentBlock(_Struct, tag="document"):
    source: Json
    title: str | None = None
    context: str | None = None
    citations: Json | None = None
    cache_control: Json | None = None


class ToolUseBlock(_Struct, tag="tool_use"):
    id: str
    name: str
    input: Json
    cache_control: Json | None = None


class ToolResultBlock(_Struct, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None
    cache_control: Json | None = None


class ThinkingBlock(_Struct, tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Struct, tag="redacted_thinking"):
    data: str


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    input_schema: Json
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Json | None = None


class ToolChoiceAuto(_Struct, tag="auto"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Struct, tag="any"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Struct, tag="tool"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Struct, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class Thinking(msgspec.Struct, forbid_unknown_fields=True):
    """``{"type": "enabled", "budget_tokens": N}`` (the budget is not enforced: the model's thinking
    counts against ``max_tokens``), ``{"type": "disabled"}`` or ``{"type": "adaptive"}`` (the chat
    template's default); ``display`` has no effect (thinking is returned as generated)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: Json


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Structured output (``format``, a JSON Schema the reply's text follows); ``effort`` has no effect."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(msgspec.Struct, forbid_unknown_fields=True):
    user_id: str | None = None


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``: the prompt, then how to generate."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: Json | None = None


_T = TypeVar("_T", bound=msgspec.Struct)


def decode(body: Json, kind: type[_T]) -> _T:
    """``body`` (a parsed JSON object) as ``kind``. Raises APIError 400 whose message names the
    field at fault (``messages[0].content[1].type``) and whose ``param`` is its top-level field."""
    try:
        return msgspec.convert(body, kind, strict=True)
    except msgspec.ValidationError as exc:
        found = _ERROR.fullmatch(str(exc))
        assert found is not None  # the pattern matches any text
        reason, path = found["reason"], (found["path"] or "").lstrip(".")
        named = _FIELD.search(reason)  # a missing or unknown field: part of the place
        where = ".".join(p for p in (path, named[1] if named else "") if p)
        param = re.split(r"[.\[]", where)[0] or None
        raise APIError(400, f"invalid request: {reason}" + (f" (at `{where}`)" if where else ""), param=param) from None


_ERROR = re.compile(r"(?P<reason>.*?)(?: - at `\$(?P<path>[^`]*)`)?", re.S)
_FIELD = re.compile(r"(?:required|unknown) field `([^`]*)`")
