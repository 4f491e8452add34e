"""The per-token outputs of a text-generation row beyond its text: logprob entries with decoded
token text, and the reasoning / tool-call split of Qwen3 output (``_parsers.Qwen3OutputParser``).

Runs client side (the caller's thread or event loop), one instance per request or row.
"""

from __future__ import annotations

from typing import Any

from ...tokenization import Tokenizer

from ._events import PromptEvent, PromptToken, TokenEvent
from ._parsers import Delta, Qwen3OutputParser, ToolCall

__all__ = ["RowParser", "TokenTexts", "tool_call_dict"]


class TokenTexts:
    """Token id -> its text as OpenAI's ``logprobs[].token``: a vocabulary token's bytes decoded
    on their own (an incomplete UTF-8 character becomes U+FFFD), an added token's text, a special
    token's string (``<|im_end|>``), "" for an id without a token. O(1) per id (the tokenizer's
    byte table)."""

    def __init__(self, tokenizer: Tokenizer):
        self._pieces = tokenizer.byte_table().pieces
        self._specials = tokenizer.special_token_strings()

    def __call__(self, token_id: int) -> str:
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""
        if isinstance(piece, bytes):
            return piece.decode("utf-8", errors="replace")
        return self._specials.get(token_id, "") if piece is None else piece

    def entry(self, event: TokenEvent | PromptToken) -> dict[str, Any]:
        """``{"token_id", "token", "logprob", "top_logprobs": [{"token_id", "token", "logprob"}]}``
        of one token event or prompt token (``top_logprobs`` empty when the row asked for none)."""
        top = [{"token_id": t, "token": self(t), "logprob": lp} for t, lp in event.top_logprobs or ()]
        return {"token_id": event.token_id, "token": self(event.token_id), "logprob": event.logprob,
                "top_logprobs": top}


    def prompt_entries(self, event: PromptEvent) -> list[dict[str, Any]]:
        """One :meth:`entry` per prompt token; the first token's (no context) has ``logprob`` None
        and no ``top_logprobs``."""
        first = {"token_id": event.first, "token": self(event.first), "logprob": None, "top_logprobs": []}
        return [first, *map(self.entry, event.tokens)]


def tool_call_dict(call: ToolCall) -> dict[str, Any]:
    """A parsed :class:`ToolCall` in OpenAI's shape: ``{"id", "type": "function", "function":
    {"name", "arguments"}}`` (``arguments`` a JSON object as a string)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class RowParser:
    """One row's text -> (content, reasoning_content, tool calls), incrementally.

    With neither ``reasoning`` nor ``tools`` the text is all content. Otherwise
    ``Qwen3OutputParser`` splits ``<think>...</think>`` (``reasoning``) and ``<tool_call>`` blocks
    (``tools``), holding back partial tags; :meth:`finish` flushes what it holds.

    ``forced`` (``tool_choice`` forced the turn's calls, so its text is ``<tool_call>`` blocks
    only): content is dropped (what is left of a call cut off by ``max_tokens``, ``'<tool'``,
    never reaches the client), and a call equal to an earlier one of the row (same name and
    arguments) is dropped and sets :attr:`repeated` (the row is done: a small model repeats its
    call until the grammar's last one otherwise)."""

    def __init__(self, *, reasoning: bool, tools: bool, forced: bool = False):
        self._parser = Qwen3OutputParser(reasoning=reasoning, tools=tools) if reasoning or tools else None
        self._forced = forced
        self._seen: set[tuple[str, str]] = set()
        self.called = False  # a tool call was emitted
        self.repeated = False  # forced: a call repeated an earlier one

    def feed(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """New text -> ``(content, reasoning_content, tool_calls)`` safe to emit now."""
        if self._parser is None:
            return text, "", []
        return self._split(self._parser.feed(text))

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """End of the row: what the parser held back (an unterminated tool call as content,
        unless ``forced``)."""
        if self._parser is None:
            return "", "", []
        return self._split(self._parser.finish())

    def _split(self, delta: Delta) -> tuple[str, str, list[dict[str, Any]]]:
        if not self._forced:
            calls = [tool_call_dict(c) for c in delta.tool_calls]
            self.called = self.called or bool(calls)
            return delta.content, delta.reasoning_content, calls
        calls = []
        for call in delta.tool_calls:
            key = (call.name, call.arguments)
            self.repeated = self.repeated or key in self._seen
            if not self.repeated:
                self._seen.add(key)
                calls.append(tool_call_dict(call))
        self.called = self.called or bool(calls)
        return "", delta.reasoning_content, calls
