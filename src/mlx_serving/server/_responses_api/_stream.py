"""A streamed response's SSE events (``{"event", "data"}``, ``data`` the event's JSON): :func:`events`.

``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``,
``response.content_part.added``, ``response.reasoning_text.delta`` / ``response.output_text.delta``
(with ``logprobs``), their ``.done`` and ``response.content_part.done``,
``response.output_item.done`` (a function call comes whole: ``added``, one
``response.function_call_arguments.delta``, ``.done``, ``output_item.done``); then
``response.completed`` or ``response.incomplete`` holding the response object :mod:`._output` would
build unstreamed (stored when the turn asks). Every event is numbered by ``sequence_number``. An
error once the stream has begun (the serving's, or the end of the shutdown grace period) ends it
with ``response.failed`` (``error.code``: "server_error"); a failed response is not stored.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...serving import AsyncStream, ServingError
from .._errors import from_exception
from .._responses import Event, chat_logprobs
from .._shutdown import Drain
from .._sse import ShuttingDown, stream_events
from ._items import Json
from ._output import envelope, finish, function_call, message, new_id, reasoning, status, usage
from ._request import Turn
from ._store import ResponseStore

__all__ = ["Recorder", "events"]


class Recorder(Protocol):
    """What the metrics see of a request (the app's ``_Recorder``)."""

    def final(self, choice: int, final: Mapping[str, Any]) -> None: ...

    def aborted(self) -> None: ...


def events(stream: AsyncStream, turn: Turn, model: str, record: Recorder, drain: Drain,
           store: ResponseStore) -> AsyncIterator[Json]:
    """The events of ``turn`` streamed from ``stream`` (see the module docstring). Leaving early
    withdraws the request; ``record`` sees each completion's final and, at the end, the aborted rest."""
    return _Streamed(turn, model, store).events(stream, record, drain)


@dataclass
class _Streamed:
    """One streamed response: its events' sequence numbers and the output items so far (one item
    open at a time: reasoning or a message takes deltas; function calls come whole). Its output
    items are those the unstreamed response would have, in the order they were generated."""

    turn: Turn
    model: str
    store: ResponseStore
    seq: int = 0
    output: list[Json] = field(default_factory=list)
    current: Json | None = None  # the open reasoning or message item
    body: Json = field(default_factory=dict)

    async def events(self, stream: AsyncStream, record: Recorder, drain: Drain) -> AsyncIterator[Json]:
        self.body = envelope(new_id("resp"), self.model, self.turn, "in_progress", int(time.time()))
        try:
            async with stream:
                yield self._event("response.created", response=dict(self.body))
                yield self._event("response.in_progress", response=dict(self.body))
                try:
                    async for ev in stream_events(stream, drain, record):
                        for e in self._feed(ev):
                            yield e
                except ShuttingDown as exc:
                    for e in self._failed(str(exc)):
                        yield e
                except (ServingError, ValueError) as exc:
                    for e in self._failed(str(from_exception(exc))):
                        yield e
        finally:
            record.aborted()

    def _event(self, kind: str, **fields: Any) -> Json:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq, **fields},
                                                  ensure_ascii=False)}

    def _feed(self, ev: Event) -> list[Json]:
        out: list[Json] = []
        if ev.delta.get("reasoning_content"):
            out += self._delta("reasoning", ev.delta["reasoning_content"], None)
        if ev.delta.get("content"):
            out += self._delta("message", ev.delta["content"], ev.logprobs)
        elif ev.logprobs and self.turn.logprobs and self.current is not None and self.current["type"] == "message":
            self.current["content"][0]["logprobs"] += chat_logprobs(ev.logprobs)  # tokens with no text of their own
        for call in ev.delta.get("tool_calls") or []:
            out += self._close() + self._call(function_call(call))
        if ev.final is not None:
            out += self._final(ev.final)
        return out

    def _call(self, item: Json) -> list[Json]:
        """A function call's events, whole; the item joins the output."""
        where = {"item_id": item["id"], "output_index": len(self.output)}
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _delta(self, kind: str, text: str, logprobs: list[Json] | None) -> list[Json]:
        """A reasoning or text delta, opening its item first unless it is the one open."""
        out: list[Json] = []
        item = self.current
        if item is None or item["type"] != kind:
            out += self._close()
            item = self._open(kind, out)
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", **where, delta=text)]
        lp = chat_logprobs(logprobs or []) if self.turn.logprobs else []
        if self.turn.logprobs:
            part["logprobs"] += lp
        return out + [self._event("response.output_text.delta", **where, delta=text, logprobs=lp)]

    def _open(self, kind: str, out: list[Json]) -> Json:
        """Open a reasoning or message item (its events go to ``out``) and return it."""
        logprobs: list[Json] | None = [] if self.turn.logprobs else None
        item = reasoning("") if kind == "reasoning" else message("", "in_progress", logprobs)
        item["status"], self.current = "in_progress", item
        out += [self._event("response.output_item.added", output_index=len(self.output), item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                            content_index=0, part={**item["content"][0]})]
        return item

    def _close(self, state: str = "completed") -> list[Json]:
        """Close the open item, if any: its done events."""
        item, self.current = self.current, None
        if item is None:
            return []
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event("response.output_text.done", **where, text=part["text"],
                               logprobs=part.get("logprobs") or [])
        item["status"] = state
        self.output.append(item)
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def _final(self, final: Mapping[str, Any]) -> list[Json]:
        state, details = status(final.get("finish_reason"))
        out: list[Json] = []
        if not any(o["type"] in ("message", "function_call") for o in self.output) and (
                self.current is None or self.current["type"] != "message"):
            out += self._close()
            self._open("message", out)  # no text and no call: an empty message, as unstreamed
        out += self._close("incomplete" if details else "completed")
        self.body.update(status=state, output=self.output, incomplete_details=details, usage=usage(final))
        body = finish(self.body, self.turn, self.store)
        kind = "response.incomplete" if state == "incomplete" else "response.completed"
        return out + [self._event(kind, response=body)]

    def _failed(self, reason: str) -> list[Json]:
        out = self._close("incomplete")
        self.body.update(status="failed", output=self.output, error={"code": "server_error", "message": reason})
        return out + [self._event("response.failed", response=self.body)]
