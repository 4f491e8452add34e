"""A streamed message's SSE events (``{"event", "data"}``, ``data`` the event's JSON): :func:`events`.

As Anthropic streams: ``message_start`` (the message with empty ``content``, ``usage.input_tokens``),
``ping``; per content block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``;
a ``tool_use`` block gets its whole input as one ``input_json_delta``), ``content_block_stop``;
then ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``) and ``message_stop``. The
blocks and their order are those of the unstreamed message (:mod:`._output`); a stop sequence is cut
from the text piece that ends with it. An error once the stream has begun (the serving's, or the
end of the shutdown grace period) ends it with an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...serving import AsyncStream, ServingError
from .._responses import Event
from .._shutdown import Drain
from .._sse import ShuttingDown, stream_events
from ._output import cut_stop, error, error_body, new_id, stop_reason, tool_use
from ._schema import Json

__all__ = ["Recorder", "events"]


class Recorder(Protocol):
    """What the metrics see of a request (the app's ``_Recorder``)."""

    def final(self, choice: int, final: Mapping[str, Any]) -> None: ...

    def aborted(self) -> None: ...


def events(stream: AsyncStream, model: str, stops: tuple[str, ...], input_tokens: int, record: Recorder,
           drain: Drain) -> AsyncIterator[Json]:
    """The events of a message streamed from ``stream`` (see the module docstring); ``input_tokens``:
    the prompt's tokens, for ``message_start``. Leaving early withdraws the request; ``record`` sees
    the final and, at the end, the aborted rest."""
    return _Streamed(model, stops, input_tokens).events(stream, record, drain)


@dataclass
class _Streamed:
    """One streamed message: its content blocks so far (one open at a time: thinking or text take
    deltas; tool_use blocks come whole) and the stop sequence seen."""

    model: str
    stops: tuple[str, ...]
    input_tokens: int
    blocks: int = 0
    open: str | None = None  # the open block's type
    stop: str | None = None
    rid: str = field(default_factory=lambda: new_id("msg"))

    async def events(self, stream: AsyncStream, record: Recorder, drain: Drain) -> AsyncIterator[Json]:
        try:
            async with stream:
                yield self._message_start()
                yield _event("ping")
                try:
                    async for ev in stream_events(stream, drain, record):
                        for e in self._feed(ev):
                            yield e
                except ShuttingDown as exc:
                    yield _event("error", **error_body(exc.error()))
                except (ServingError, ValueError) as exc:
                    yield _event("error", **error_body(error(exc)))
        finally:
            record.aborted()

    def _message_start(self) -> Json:
        message: Json = {"id": self.rid, "type": "message", "role": "assistant", "content": [], "model": self.model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return _event("message_start", message=message)

    def _feed(self, ev: Event) -> list[Json]:
        out: list[Json] = []
        if ev.delta.get("reasoning_content"):
            out += self._delta("thinking", ev.delta["reasoning_content"])
        text = ev.delta.get("content", "")
        if self.stops and text:
            text, self.stop = cut_stop(text, self.stops)
        if text:
            out += self._delta("text", text)
        for call in ev.delta.get("tool_calls") or []:
            block = tool_use(call)
            out += self._close() + [self._start({**block, "input": {}}),
                                    self._block_delta("input_json_delta", partial_json=json.dumps(block["input"])),
                                    self._stop_block()]
        if ev.final is not None:
            out += self._final(ev.final)
        return out

    def _delta(self, kind: str, text: str) -> list[Json]:
        """A thinking or text delta, opening its block first unless it is the one open."""
        out: list[Json] = []
        if self.open != kind:
            out += self._close()
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""}))
            self.open = kind
        return out + [self._block_delta(f"{kind}_delta", **{kind: text})]

    def _start(self, block: Json) -> Json:
        return _event("content_block_start", index=self.blocks, content_block=block)

    def _block_delta(self, kind: str, **fields: Any) -> Json:
        return _event("content_block_delta", index=self.blocks, delta={"type": kind, **fields})

    def _stop_block(self) -> Json:
        self.blocks += 1
        return _event("content_block_stop", index=self.blocks - 1)

    def _close(self) -> list[Json]:
        if self.open is None:
            return []
        self.open = None
        return [self._stop_block()]

    def _final(self, final: Mapping[str, Any]) -> list[Json]:
        out = self._close()
        if self.blocks == 0:  # nothing generated: an empty text block, as unstreamed
            out += [self._start({"type": "text", "text": ""}), self._stop_block()]
        stop = self.stop if final["finish_reason"] == "stop" else None
        usage = {"input_tokens": final["token_summary"]["input"], "output_tokens": final["num_tokens"]}
        return out + [_event("message_delta", delta={"stop_reason": stop_reason(final["finish_reason"], stop),
                                                     "stop_sequence": stop}, usage=usage),
                      _event("message_stop")]


def _event(kind: str, **fields: Any) -> Json:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}
