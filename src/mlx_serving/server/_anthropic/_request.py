"""A Messages API body -> the text-generation input the chat route builds: :func:`turn`, :func:`prompt`.

``system`` becomes a system message; each user turn's ``tool_result`` blocks become tool messages
(``tool_call_id``: the block's ``tool_use_id``) and its text blocks one user message, in block
order; an assistant turn's text, ``thinking`` and ``tool_use`` blocks become one assistant message
(``content``, ``reasoning_content``, ``tool_calls`` with the input as JSON text). Custom ``tools``
become chat tools; ``tool_choice`` auto / any / tool / none map to the chat route's auto /
"required" / a named function / none (tools then left out of the prompt), and
``disable_parallel_tool_use`` to ``parallel_tool_calls: false``. ``max_tokens`` ->
``max_new_tokens``, ``stop_sequences`` -> ``stop`` (kept in the output, so that the reply can say
which one matched: :mod:`._output` cuts it), ``thinking`` -> ``enable_thinking`` (enabled: true,
disabled: false, adaptive: the template's default), ``output_config.format`` -> a ``json_schema``
``response_format``; sampling fields keep their names. Image and document blocks, and a final
assistant message (a prefill), are refused with APIError 400 naming the block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .._errors import APIError
from .._requests import Call
from ._schema import (CountTokensRequest, DocumentBlock, ImageBlock, Json, Message, MessagesRequest,
                      RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolChoiceAny, ToolChoiceNone, ToolChoiceTool,
                      ToolResultBlock, ToolUseBlock, decode)

__all__ = ["Prompt", "Turn", "prompt", "turn"]


@dataclass(frozen=True)
class Prompt:
    """What a request renders into its prompt: ``model`` (the name it asks for), ``messages`` and
    ``tools`` in the chat template's shape, ``enable_thinking`` (None: the template's default)."""

    model: str
    messages: list[Json]
    tools: list[Json] | None
    enable_thinking: bool | None


@dataclass(frozen=True)
class Turn:
    """One ``POST /v1/messages`` request, mapped: its ``prompt``, the chat route's ``call`` (the
    text-generation input, ``stream``) and its ``stop_sequences``."""

    prompt: Prompt
    call: Call
    stop_sequences: tuple[str, ...]


def prompt(body: Json) -> Prompt:
    """A ``POST /v1/messages/count_tokens`` body's prompt. Raises APIError 400 naming the field."""
    return _prompt(decode(body, CountTokensRequest))


def turn(body: Json) -> Turn:
    """A ``POST /v1/messages`` body, mapped (see the module docstring). Raises APIError 400 naming
    the field at fault; the values themselves (``max_tokens`` >= 1, ``temperature`` >= 0, ...) are
    checked by the serving."""
    request = decode(body, MessagesRequest)
    mapped = _prompt(request)
    spec: Json = {"messages": mapped.messages, "max_new_tokens": request.max_tokens}
    if mapped.tools is not None:
        spec["tools"] = mapped.tools
        spec.update(_tool_choice(request))
    if mapped.enable_thinking is not None:
        spec["enable_thinking"] = mapped.enable_thinking
    if request.output_config is not None and request.output_config.format is not None:
        schema = request.output_config.format.schema
        spec["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(request, key) is not None:
            spec[key] = getattr(request, key)
    stops = tuple(request.stop_sequences or ())
    if stops:
        spec.update(stop=list(stops), include_stop_str_in_output=True)
    call = Call(spec, stream=bool(request.stream), include_usage=False, deadline=None, n=1, prompts=1,
                fields={"max_new_tokens": "max_tokens", "stop": "stop_sequences"})
    return Turn(mapped, call, stops)


def _prompt(request: CountTokensRequest) -> Prompt:
    if not request.messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    if request.messages[-1].role == "assistant":
        raise APIError(400, "the last message must be a user message: continuing an assistant message (a "
                            "prefill) is not supported", param="messages")
    messages = [] if request.system is None else [{"role": "system", "content": _system(request.system)}]
    for i, message in enumerate(request.messages):
        messages += _user(message, i) if message.role == "user" else [_assistant(message, i)]
    tools = None
    if request.tools and not isinstance(request.tool_choice, ToolChoiceNone):
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in request.tools]
    elif request.tool_choice is not None and not request.tools and not isinstance(request.tool_choice,
                                                                                 ToolChoiceNone):
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    thinking = None if request.thinking is None or request.thinking.type == "adaptive" else (
        request.thinking.type == "enabled")
    return Prompt(request.model, messages, tools, thinking)


def _system(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "".join(b.text for b in system)


def _blocks(message: Message) -> list[Any]:
    return [TextBlock(message.content)] if isinstance(message.content, str) else list(message.content)


def _refuse(block: object, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise APIError(400, f"{where}: {kind} blocks are not supported (this server serves text-only models)",
                       param="messages")


def _user(message: Message, i: int) -> list[Json]:
    """A user turn: tool messages for its tool results, one user message per run of text blocks."""
    out: list[Json] = []
    for j, block in enumerate(_blocks(message)):
        where = f"messages[{i}].content[{j}]"
        _refuse(block, where)
        if isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
        elif isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block, where)})
        else:
            raise APIError(400, f"{where}: a user message holds text and tool_result blocks only, got "
                                f"{type(block).__name__}", param="messages")
    return out


def _result(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        return block.content
    for k, part in enumerate(block.content):
        _refuse(part, f"{where}.content[{k}]")
    return "".join(p.text for p in block.content if isinstance(p, TextBlock))


def _assistant(message: Message, i: int) -> Json:
    """An assistant turn as one message: its text, thinking and tool calls."""
    text, thinking, calls = [], [], []
    for j, block in enumerate(_blocks(message)):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking: nothing to show the model
            raise APIError(400, f"messages[{i}].content[{j}]: an assistant message holds text, thinking and "
                                f"tool_use blocks only, got {type(block).__name__}", param="messages")
    out: Json = {"role": "assistant", "content": "".join(text)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_choice(request: MessagesRequest) -> Json:
    """The chat route's ``tool_choice`` / ``parallel_tool_calls`` for the request's."""
    choice = request.tool_choice
    out: Json = {}
    if isinstance(choice, ToolChoiceAny):
        out["tool_choice"] = "required"
    elif isinstance(choice, ToolChoiceTool):
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice is not None and not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out
