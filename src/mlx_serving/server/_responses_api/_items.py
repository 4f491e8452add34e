"""A Responses conversation: its ``input`` items normalized (:class:`Item`), and as chat messages.

``input`` is a string (one user message) or a list of items: ``message`` (role user, system,
developer or assistant; string or ``input_text`` / ``output_text`` / ``refusal`` content),
``function_call``, ``function_call_output`` and ``reasoning``. :func:`items_of` raises
:class:`~.._errors.APIError` 400 (param ``input``) for anything else, naming the place and field;
:func:`messages_of` maps items to the chat path's ``messages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...serving._json import JSON
from .._errors import APIError

__all__ = ["Item", "Json", "items_of", "messages_of"]

Json = dict[str, Any]

_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "reasoning": {"type", "id", "summary", "content", "status"}}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


@dataclass(frozen=True, slots=True)
class Item:
    """One conversation item, normalized. ``kind``: "message" (``role``: user, system, developer or
    assistant; ``text``: its content), "function_call" (``call_id``, ``name``; ``text``: the
    arguments' JSON), "function_call_output" (``call_id``; ``text``: the output) or "reasoning"
    (``text``: the reasoning)."""

    kind: str
    text: str
    role: str = ""
    call_id: str = ""
    name: str = ""

    def chars(self) -> int:
        return len(self.text) + len(self.call_id) + len(self.name)


def items_of(value: JSON) -> list[Item]:
    """A request's ``input`` as items: a string is one user message. Raises APIError 400 (param
    ``input``) for anything else than a string or a list of the supported items."""
    if isinstance(value, str):
        return [Item("message", value, role="user")]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of input items")
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _bad(message: str) -> APIError:
    return APIError(400, message, param="input")


def _item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be an object")
    raw = {k: v for k, v in raw.items() if v is not None}
    kind = raw.get("type", "message")
    if kind not in _ITEM_KEYS:
        raise _bad(f"{where}: items of type {kind!r:.80} are not supported (supported: {sorted(_ITEM_KEYS)})")
    unknown = sorted(set(raw) - _ITEM_KEYS[kind])
    if unknown:
        raise _bad(f"{where}: unknown field {unknown[0]!r:.80} in a {kind} item")
    if kind == "message":
        role = raw.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r:.80}")
        return Item("message", _text(raw.get("content"), f"{where}.content"), role=role)
    if kind == "reasoning":
        parts = raw.get("content") or raw.get("summary") or []
        return Item("reasoning", _text(parts, f"{where}.content", ("reasoning_text", "summary_text")))
    call_id = raw.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.call_id must be a non-empty string")
    if kind == "function_call_output":
        return Item(kind, _text(raw.get("output"), f"{where}.output"), call_id=call_id)
    name, arguments = raw.get("name"), raw.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise _bad(f"{where}: 'name' and 'arguments' (JSON text) must be strings")
    return Item(kind, arguments, call_id=call_id, name=name)


def _text(content: Any, where: str, kinds: tuple[str, ...] = tuple(_TEXT_PARTS)) -> str:
    """A string, or the joined text of a list of text parts (``input_text``, ``output_text``,
    ``refusal``; ``kinds`` for reasoning)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind, "text") if kind in kinds else None
        if key is None or not isinstance(part.get(key), str):
            raise _bad(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r:.80}")
        texts.append(part[key])
    return "".join(texts)


def messages_of(items: list[Item], instructions: str | None) -> list[Json]:
    """Chat messages for ``items``: ``instructions`` first (a system message); an assistant turn's
    reasoning, text and function calls joined into one assistant message; outputs as tool messages."""
    out: list[Json] = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        fresh = last if last is not None and not last["content"] and "tool_calls" not in last else None
        if it.kind == "message" and it.role != "assistant":
            out.append({"role": it.role, "content": it.text})
        elif it.kind == "message" and fresh is not None:
            fresh["content"] = it.text  # the text after this turn's reasoning
        elif it.kind == "message":
            out.append({"role": "assistant", "content": it.text})
        elif it.kind == "reasoning" and fresh is not None and "reasoning_content" not in fresh:
            fresh["reasoning_content"] = it.text
        elif it.kind == "reasoning":
            out.append({"role": "assistant", "content": "", "reasoning_content": it.text})
        elif it.kind == "function_call":
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.text}}
            if last is None:
                out.append(last := {"role": "assistant", "content": ""})
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": it.text})
    return out
