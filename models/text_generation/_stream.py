"""Client-side stream state: token ids -> UTF-8-safe text pieces, stop strings held back.

One :class:`GenerationTransducer` per request (built by ``Serving.streaming``); it runs in the
caller's thread or event loop, never on the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...tokenization import StreamingDetokenizer, Tokenizer

from ..generation.events import FinishReason
from ._events import TokenEvent
from ._inputs import RequestInfo

__all__ = ["GenerationTransducer", "RowText", "collect"]


@dataclass
class RowText:
    """Text state of one row: its detokenizer, stop strings, held-back tail, token count, the
    ``elapsed_ms`` of its first and latest events, finish."""

    detok: StreamingDetokenizer
    stops: tuple[str, ...]
    held: str = ""
    tokens: int = 0
    first_ms: float | None = None
    last_ms: float = 0.0
    finish_reason: FinishReason | None = None

    def count(self, event: TokenEvent) -> None:
        """Count one token event and note its time."""
        self.tokens += 1
        if self.first_ms is None:
            self.first_ms = event.elapsed_ms
        self.last_ms = event.elapsed_ms

    def timing(self) -> dict[str, float]:
        """``{"prefill_ms": admission -> first token, "decode_ms": first -> last token,
        "total_ms": admission -> last token}`` in milliseconds."""
        first = self.last_ms if self.first_ms is None else self.first_ms
        return {"prefill_ms": first, "decode_ms": self.last_ms - first, "total_ms": self.last_ms}

    def push(self, text: str) -> str:
        """Add new text; return what is safe to emit. Sets ``finish_reason`` to STOP when a stop
        string appears (the text from it on is dropped)."""
        buf = self.held + text
        cut = _first_stop(buf, self.stops)
        if cut is not None:
            self.held, self.finish_reason = "", FinishReason.STOP
            return buf[:cut]
        keep = _partial_stop_len(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class GenerationTransducer:
    """Serving transducer for text generation (see ``serving.Transducer``).

    Items: for a single input, ``str`` pieces then one final ``dict`` with ``finish_reason``
    ("stop": EOS or a stop string; "length": max_new_tokens), ``num_tokens``, ``token_summary``
    (``{"input", "output"}`` tokens) and, when ``profile_timing``, ``timing`` (ms, see
    :meth:`RowText.timing`; the same for every finish reason); for a list input,
    ``(row_index, item)`` pairs. ``"".join`` of a row's pieces equals its non-streamed
    ``generated_text``.
    """

    def __init__(self, tokenizer: Tokenizer, info: RequestInfo, profile_timing: bool = True):
        self._info, self._profile = info, profile_timing
        self._rows = [RowText(StreamingDetokenizer(tokenizer), stops) for stops in info.stops]
        self._stop: list[int] = []
        self.live = any(info.stops)  # only stop strings need tokens as they arrive

    def feed(self, row_index: int, event: TokenEvent) -> list[Any]:
        """One :class:`TokenEvent` of row ``row_index`` -> items."""
        row = self._rows[row_index]
        if row.finish_reason is not None:
            return []
        row.count(event)
        text = row.detok.add(event.token_id)
        if event.finish_reason is not None:
            text += row.detok.finalize()
        out = row.push(text)
        if row.finish_reason is not None:
            self._stop.append(row_index)
        elif event.finish_reason is not None:
            out += row.held
            row.held, row.finish_reason = "", event.finish_reason
        return self._items(row_index, out, row)

    def stop_rows(self) -> list[int]:
        """Rows whose stop string was found since the last call (the serving cancels them)."""
        rows, self._stop = self._stop, []
        return rows

    def close(self) -> list[Any]:
        """Nothing is left: every row emitted its final event when it finished or stopped."""
        return []

    def _items(self, row_index: int, text: str, row: RowText) -> list[Any]:
        items: list[Any] = [text] if text else []
        if row.finish_reason is not None:
            items.append(self._final(row_index, row))
        return [(row_index, it) for it in items] if self._info.is_list else items

    def _final(self, row_index: int, row: RowText) -> dict[str, Any]:
        assert row.finish_reason is not None
        done: dict[str, Any] = {
            "finish_reason": row.finish_reason.value,
            "num_tokens": row.tokens,
            "token_summary": {"input": self._info.input_tokens[row_index], "output": row.tokens},
        }
        if self._profile:
            done["timing"] = row.timing()
        return done


def collect(items: list[Any], info: RequestInfo) -> Any:
    """Non-streamed result from a request's items: ``{"results": [...]}`` (a list of those for a
    list input), each result ``{"generated_text", "num_tokens", "finish_reason", "token_summary"
    [, "timing"]}``."""
    rows: list[dict[str, Any]] = [{"generated_text": []} for _ in info.input_tokens]
    for item in items:
        index, value = item if info.is_list else (0, item)
        if isinstance(value, str):
            rows[index]["generated_text"].append(value)
        else:
            rows[index].update(value)
    for r in rows:
        r["generated_text"] = "".join(r["generated_text"])
    results = [{"results": [r]} for r in rows]
    return results if info.is_list else results[0]
