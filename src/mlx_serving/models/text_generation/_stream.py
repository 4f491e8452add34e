"""Client-side stream state: token ids -> UTF-8-safe text pieces, stop strings held back, and the
outputs beyond text (logprobs, reasoning, tool calls) of rows that ask for them.

One :class:`GenerationTransducer` per request (built by ``Serving.streaming``); it runs in the
caller's thread or event loop, never on the executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...serving._json import JSONObject
from ...tokenization import StreamingDetokenizer, Tokenizer

from ..generation.events import FinishReason
from ._events import PromptEvent, TokenEvent
from ._inputs import RequestInfo, RowOutput
from ._outputs import RowParser, TokenTexts
from ._parsers import partial_suffix

__all__ = ["GenerationTransducer", "RowText", "collect"]


@dataclass(slots=True)
class RowText:
    """Text state of one row: its detokenizer, stop strings, held-back tail, token count, the
    ``elapsed_ms`` of its first and latest events and the gaps between its events, finish; ``pieces``: the row's items are its
    str pieces as they come (no stop strings, no deltas), the transducer's per-token fast path."""

    detok: StreamingDetokenizer
    stops: tuple[str, ...]
    pieces: bool = False
    keep_stop: bool = False
    held: str = ""
    tokens: int = 0
    first_ms: float | None = None
    cached: int | None = None  # prompt tokens the engine found in the prefix cache
    last_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def timing(self) -> dict[str, Any]:
        """``{"prefill_ms": admission -> first token, "decode_ms": first -> last token,
        "total_ms": admission -> last token, "itl_ms": [gap, ...]}`` in milliseconds; ``itl_ms``
        holds the ``tokens - 1`` inter-token latencies (first -> second token, ...), summing to
        ``decode_ms``."""
        first = self.last_ms if self.first_ms is None else self.first_ms
        return {"prefill_ms": first, "decode_ms": self.last_ms - first, "total_ms": self.last_ms,
                "itl_ms": list(self.gaps_ms)}

    def push(self, text: str) -> str:
        """Add new text; return what is safe to emit. Sets ``finish_reason`` to STOP when a stop
        string appears (the text after it is dropped; the stop string too unless ``keep_stop``)."""
        if not self.stops:  # nothing to hold back (held stays ""): the common per-token path
            return text
        buf = self.held + text
        hit = _first_stop(buf, self.stops)
        if hit is not None:
            self.held, self.finish_reason = "", FinishReason.STOP
            return buf[: hit[0] + hit[1]] if self.keep_stop else buf[: hit[0]]
        keep = partial_suffix(buf, *self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, int] | None:
    """``(index, length)`` of the earliest stop string in ``text`` (the longest at that index)."""
    hits = [(i, -len(s)) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    if not hits:
        return None
    i, neg = min(hits)
    return i, -neg


class GenerationTransducer:
    """Serving transducer for text generation (see ``serving.Transducer``).

    Items of an input whose rows are plain (n 1, no logprobs, tools or thinking): ``str`` pieces
    then one final ``dict`` with ``finish_reason`` ("stop": EOS, a stop string or a complete
    grammar; "length": max_new_tokens), ``num_tokens``, ``token_summary`` (``{"input", "output"}``
    tokens, and ``"cached"``: prompt tokens the engine found in its prefix cache, on the paged KV
    cache) and, when ``profile_timing``, ``timing`` (ms, see :meth:`RowText.timing`; the same for
    every finish reason). Items of an input with ``n`` > 1, logprobs, tools or thinking (its
    :class:`RowOutput` has ``deltas``): delta dicts ``{"index", "content"[, "reasoning_content"]
    [, "tool_calls"][, "logprobs"][, "token_summary"]}`` (index: which of its n completions;
    logprobs: one entry per token of the event, see ``TokenTexts.entry``; token_summary, with
    ``stream_usage``: ``{"input", "output"}`` tokens so far), then per completion a final dict as above with
    ``"index"`` (``finish_reason`` "tool_calls" when it emitted a tool call and was not cut by
    max_new_tokens; a forced turn whose call repeats an earlier one ends there, the repeat
    dropped: ``RowParser``). For a list input
    every item is an ``(input_index, item)`` pair. A row's joined ``content`` (or pieces) equals
    its non-streamed ``generated_text``. A row asking for ``prompt_logprobs`` first gives the delta
    ``{"index", "content": "", "prompt_logprobs": [...]}`` (and with ``max_new_tokens`` 0 its final
    dict right after: ``finish_reason`` "length", ``num_tokens`` 0).
    """

    def __init__(self, tokenizer: Tokenizer, info: RequestInfo, profile_timing: bool = True):
        self._info, self._profile = info, profile_timing
        self._outputs = [info.output(r) for r in range(len(info.stops))]
        self._rows = [RowText(StreamingDetokenizer(tokenizer), stops, pieces=not (stops or output.deltas),
                              keep_stop=output.keep_stop) for stops, output in zip(info.stops, self._outputs)]
        self._parsers = [RowParser(reasoning=o.reasoning, tools=o.tools, forced=o.forced) for o in self._outputs]
        self._texts = TokenTexts(tokenizer) if any(o.logprobs or o.prompt_logprobs for o in self._outputs) else None
        self._stop: list[int] = []
        # only stop strings and forced tool calls (a repeated call ends the row) need tokens as they arrive
        self.live = any(info.stops) or any(o.forced for o in self._outputs)

    def feed(self, row_index: int, event: TokenEvent | PromptEvent) -> list[Any]:
        """One :class:`TokenEvent` (or the row's first event, a :class:`PromptEvent`) of row
        ``row_index`` -> items."""
        row = self._rows[row_index]
        if row.finish_reason is not None:
            return []
        if isinstance(event, PromptEvent):
            return self._feed_prompt(row_index, row, event)
        row.tokens += 1  # count the event and note its time
        if row.first_ms is None:
            row.first_ms, row.cached = event.elapsed_ms, event.cached_tokens
        else:
            row.gaps_ms.append(event.elapsed_ms - row.last_ms)
        row.last_ms = event.elapsed_ms
        text = row.detok.add(event.token_id)
        if row.pieces and event.finish_reason is None:  # the common per-token path: the piece as is
            if not text:
                return []
            return [(self._outputs[row_index].input, text)] if self._info.is_list else [text]
        return self._feed_rest(row_index, row, event, text)

    def _feed_prompt(self, row_index: int, row: RowText, event: PromptEvent) -> list[Any]:
        """A row's prompt log-probabilities: the delta ``{"index", "content": "", "prompt_logprobs":
        [entry per prompt token]}``, then the row's final dict when it generates nothing."""
        assert self._texts is not None
        output = self._outputs[row_index]
        items: list[Any] = [{"index": output.index, "content": "", "prompt_logprobs": self._texts.prompt_entries(event)}]
        if event.finish_reason is not None:
            row.finish_reason = event.finish_reason
            items.append({"index": output.index, **self._final(row_index, row)})
        return [(output.input, it) for it in items] if self._info.is_list else items

    def _feed_rest(self, row_index: int, row: RowText, event: TokenEvent, text: str) -> list[Any]:
        """``feed`` of a row's last event, or of a row with stop strings or deltas."""
        if event.finish_reason is not None:
            text += row.detok.finalize()
        out = row.push(text)
        if row.finish_reason is not None:
            self._stop.append(row_index)
        elif event.finish_reason is not None:
            out += row.held
            row.held, row.finish_reason = "", event.finish_reason
        output = self._outputs[row_index]
        if output.deltas:
            items = self._delta_items(row_index, out, row, event)
        else:
            items = [out] if out else []
            if row.finish_reason is not None:
                items.append(self._final(row_index, row))
        return [(output.input, it) for it in items] if self._info.is_list else items

    def stop_rows(self) -> list[int]:
        """Rows whose stop string was found since the last call (the serving cancels them)."""
        rows, self._stop = self._stop, []
        return rows

    def close(self) -> list[Any]:
        """Nothing is left: every row emitted its final event when it finished or stopped."""
        return []

    def _delta_items(self, row_index: int, text: str, row: RowText, event: TokenEvent) -> list[Any]:
        output, parser = self._outputs[row_index], self._parsers[row_index]
        content, reasoning, calls = parser.feed(text)
        if parser.repeated and row.finish_reason is None:  # a forced turn repeats a call: it is done
            row.finish_reason = FinishReason.STOP
            self._stop.append(row_index)
        if row.finish_reason is not None:
            rest = parser.finish()
            content, reasoning, calls = content + rest[0], reasoning + rest[1], calls + rest[2]
        delta: dict[str, Any] = {"index": output.index, "content": content}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = calls
        if output.logprobs:
            assert self._texts is not None
            delta["logprobs"] = [self._texts.entry(event)]
        has_more = len(delta) > 2  # reasoning, tool calls or logprobs beside index and content
        if output.usage:
            delta["token_summary"] = {"input": self._info.input_tokens[row_index], "output": row.tokens}
        items: list[Any] = [delta] if delta["content"] or has_more else []
        if row.finish_reason is not None:
            final = self._final(row_index, row)
            if parser.called and row.finish_reason is not FinishReason.LENGTH:  # cut off: "length", as OpenAI
                final["finish_reason"] = FinishReason.TOOL_CALLS.value
            items.append({"index": output.index, **final})
        return items

    def _final(self, row_index: int, row: RowText) -> dict[str, Any]:
        assert row.finish_reason is not None
        done: dict[str, Any] = {
            "finish_reason": row.finish_reason.value,
            "num_tokens": row.tokens,
            "token_summary": {"input": self._info.input_tokens[row_index], "output": row.tokens},
        }
        if row.cached is not None:
            done["token_summary"]["cached"] = row.cached
        if self._profile:
            done["timing"] = row.timing()
        return done


def collect(items: list[Any], info: RequestInfo) -> JSONObject | list[JSONObject]:
    """Non-streamed result from a request's items: ``{"results": [...]}`` (a list of those for a
    list input), ``results`` holding one entry per completion (``n`` of them): ``{"generated_text",
    "num_tokens", "finish_reason", "token_summary"[, "timing"][, "logprobs"][, "reasoning_content"]
    [, "tool_calls"][, "prompt_logprobs"]}``; ``logprobs`` when asked for (one entry per token),
    ``prompt_logprobs`` when asked for (one entry per prompt token, the first with ``logprob``
    None; see ``TokenTexts.prompt_entries``), ``reasoning_content``
    when the output had reasoning text, ``tool_calls`` when it called a tool."""
    if not info.is_list and len(info.stops) == 1 and not info.output(0).deltas:  # one row of str pieces
        entry = _Entry(info.output(0))
        append = entry.content.append
        for value in items:
            if type(value) is str:
                append(value)
            else:
                entry.add(value)
        return {"results": [entry.result()]}
    outputs = [info.output(r) for r in range(len(info.stops))]
    rows = {(o.input, o.index): _Entry(o) for o in outputs}
    for item in items:
        input_index, value = item if info.is_list else (0, item)
        if isinstance(value, str):
            rows[(input_index, 0)].content.append(value)
        else:
            rows[(input_index, value.get("index", 0))].add(value)
    results: list[dict[str, Any]] = [{"results": []} for _ in range(info.num_inputs)]
    for (input_index, _), entry in rows.items():
        results[input_index]["results"].append(entry.result())
    return results if info.is_list else results[0]


class _Entry:
    """One completion's result, gathered from its items."""

    def __init__(self, output: RowOutput):
        self.output = output
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.prompt_logprobs: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}

    def add(self, value: dict[str, Any]) -> None:
        """A delta dict or the final dict."""
        if "finish_reason" in value:
            self.final = {k: v for k, v in value.items() if k != "index"}
            return
        self.content.append(value.get("content", ""))
        self.reasoning.append(value.get("reasoning_content", ""))
        self.tool_calls += value.get("tool_calls", [])
        self.logprobs += value.get("logprobs", [])
        self.prompt_logprobs += value.get("prompt_logprobs", [])

    def result(self) -> dict[str, Any]:
        """``{"generated_text", **final}`` plus the extra outputs this completion has."""
        entry: dict[str, Any] = {"generated_text": "".join(self.content), **self.final}
        if self.output.logprobs:
            entry["logprobs"] = self.logprobs
        if self.output.prompt_logprobs:
            entry["prompt_logprobs"] = self.prompt_logprobs
        reasoning = "".join(self.reasoning)
        if reasoning:
            entry["reasoning_content"] = reasoning
        if self.tool_calls:
            entry["tool_calls"] = self.tool_calls
        return entry
