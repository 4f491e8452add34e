"""Qwen3 output parsing: ``<think>`` reasoning and hermes-style ``<tool_call>`` blocks, incremental
over the streaming detokenizer's text pieces.

Follows vLLM's parsers (``vllm/reasoning/qwen3_reasoning_parser.py``,
``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``): text between ``<think>`` and
``</think>`` is reasoning; each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` is one
call whose ``arguments`` become a JSON string (``json.dumps(..., ensure_ascii=False)``); a block
whose JSON does not parse stays content, tags included. Differences, so that a stream needs no
re-parse: a tool call is emitted whole once its closing tag arrives (no partial-JSON deltas); text
around tool calls stays content (vLLM's one-shot parse keeps only the text before the first);
whitespace next to a tool call is dropped. Newlines are trimmed as Qwen3's chat template trims
them when it renders an assistant turn (``reasoning_content.strip('\\n')``, content after
``</think>`` ``lstrip('\\n')``), so the parsed fields round-trip through the template.

Reasoning is recognised only when the output starts with ``<think>`` (Qwen3 writes it first when
thinking is on; with ``enable_thinking=False`` the template puts an empty think block in the prompt
and the output has none).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

__all__ = ["Delta", "Qwen3OutputParser", "ToolCall", "parse_tool_call", "partial_suffix"]

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call: the function's ``name`` and its ``arguments`` as a JSON object
    string (the OpenAI shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)


@dataclass(frozen=True)
class Delta:
    """What one ``feed`` (or ``finish``) adds to each output field."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags`` (0 if
    none), in characters. Also holds back partial stop strings (``_stream.RowText.push``)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def parse_tool_call(body: str) -> ToolCall | None:
    """The call in one ``<tool_call>`` block's text, or None when it is not a JSON object with a
    non-empty string ``name`` and an object ``arguments`` (absent: ``{}``; a string holding a JSON
    object is accepted, as some models write it)."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class _Out:
    """The pieces one ``feed`` produces."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def delta(self) -> Delta:
        return Delta("".join(self.content), "".join(self.reasoning), tuple(self.calls))


class Qwen3OutputParser:
    """Splits a Qwen3 output stream into content, reasoning and tool calls, one request each.

    ``feed(piece)`` takes the next detokenized text piece and returns what it completes; text that
    may be the start of a tag (``"<th"``, ``"</tool_"``...) and trailing newlines are held back
    until the next piece decides. ``finish()`` flushes what is held: an unterminated ``<tool_call>``
    becomes content; an unterminated think block stays reasoning (the output was cut short).
    For any split of a text into pieces, the concatenated deltas are the same.

    Args:
        reasoning: split a leading ``<think>...</think>`` into ``reasoning_content``.
        tools: parse ``<tool_call>{json}</tool_call>`` blocks into ``tool_calls``; when False the
            tags stay content.
    """

    def __init__(self, *, reasoning: bool, tools: bool) -> None:
        self._tools = tools
        self._state = self._start if reasoning else self._content
        self._buf = ""  # text not yet decided
        self._reasoning_started = False  # leading newlines of reasoning are dropped until then
        self._trim_content = False  # drop newlines that follow </think>
        self._space = ""  # whitespace held in content (dropped next to a tool call)
        self._after_call = False

    def feed(self, text: str) -> Delta:
        """The delta completed by ``text`` (the next piece of the output)."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Delta:
        """The rest of the output, at the end of the stream."""
        delta = self._drain(final=True)
        self._state = self._content
        return delta

    def _drain(self, final: bool) -> Delta:
        out = _Out()
        while self._state(out, final):
            pass
        if final:
            if not self._after_call:
                out.content.append(self._space)
            self._space = ""
        return out.delta()

    # Each state consumes what it can of the buffer and returns True to run the next state.

    def _start(self, out: _Out, final: bool) -> bool:
        if self._buf.startswith(THINK_START):
            self._buf = self._buf[len(THINK_START):]
            self._state = self._think
            return True
        if THINK_START.startswith(self._buf) and not final:
            return False
        self._state = self._content
        return True

    def _think(self, out: _Out, final: bool) -> bool:
        if not self._reasoning_started:
            self._buf = self._buf.lstrip("\n")
        end = self._buf.find(THINK_END)
        if end >= 0:
            self._emit_reasoning(out, self._buf[:end].rstrip("\n"))
            self._buf = self._buf[end + len(THINK_END):]
            self._state, self._trim_content = self._content, True
            return True
        if final:
            self._emit_reasoning(out, self._buf.rstrip("\n"))
            self._buf = ""
            return False
        cut = len(self._buf) - partial_suffix(self._buf, THINK_END)
        cut = len(self._buf[:cut].rstrip("\n"))
        self._emit_reasoning(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _emit_reasoning(self, out: _Out, text: str) -> None:
        if text:
            out.reasoning.append(text)
            self._reasoning_started = True

    def _content(self, out: _Out, final: bool) -> bool:
        if self._trim_content:
            self._buf = self._buf.lstrip("\n")
            self._trim_content = not self._buf
        if not self._tools:
            out.content.append(self._buf)
            self._buf = ""
            return False
        start = self._buf.find(CALL_START)
        if start >= 0:
            self._emit_content(out, self._buf[:start])
            self._buf = self._buf[start + len(CALL_START):]
            self._state = self._call
            return True
        cut = len(self._buf) - (0 if final else partial_suffix(self._buf, CALL_START))
        self._emit_content(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _emit_content(self, out: _Out, text: str) -> None:
        """Append ``text`` to content, holding its trailing whitespace in ``_space`` (dropped if a
        valid tool call follows) and dropping leading whitespace right after a tool call."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if self._after_call:
            body = body.lstrip()
        if body:
            out.content.append(body)
            self._after_call = False

    def _call(self, out: _Out, final: bool) -> bool:
        end = self._buf.find(CALL_END)
        if end < 0:
            if final:
                self._emit_content(out, CALL_START + self._buf)
                self._buf, self._state = "", self._content
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(CALL_END):]
        call = parse_tool_call(body)
        if call is None:
            self._emit_content(out, CALL_START + body + CALL_END)
        else:
            out.calls.append(call)
            self._space, self._after_call = "", True
        self._state = self._content
        return True
