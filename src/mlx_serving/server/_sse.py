"""What every streamed route (chat and completions in ``_app``, the Responses API's events) reads
its stream with.

:func:`next_items` waits for a stream's next item under the shutdown's :meth:`~._shutdown.Drain.scope`
and returns it with everything else already there, runs of text pieces joined (:func:`joined`):
``[]`` at the stream's end; :class:`ShuttingDown` when the grace period ends first (what the stream
raises, ``ServingError`` or ``ValueError``, is raised as is). The caller turns those into its own
events, outside the scope.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, Protocol

from ..serving import AsyncStream
from ._errors import APIError
from ._responses import Event, StreamItem, event
from ._shutdown import Drain

__all__ = ["ShuttingDown", "joined", "next_items"]


class _End(enum.Enum):
    END = enum.auto()


_END: Final = _End.END  # what ``anext`` gives at the stream's end (no stream item is it)


class ShuttingDown(Exception):
    """The shutdown grace period (``grace`` seconds) ended while a request waited; ``str()`` says so."""

    def __init__(self, grace: float) -> None:
        super().__init__(f"the server is shutting down: the request was ended {grace:g} s after shutdown began")

    def error(self) -> APIError:
        """The error event's body: 503, code ``shutting_down``."""
        return APIError(503, str(self), "server_error", code="shutting_down")


async def next_items(stream: AsyncStream[StreamItem], drain: Drain) -> list[StreamItem]:
    """The next item of ``stream`` (awaited under ``drain.scope()``), then those already waiting, joined;
    ``[]`` once the stream ended. Raises :class:`ShuttingDown`, or what the stream raises."""
    item: StreamItem | _End = _END
    with drain.scope() as waiting:
        item = await anext(stream, _END)
    if waiting.cancelled_caught:
        raise ShuttingDown(drain.grace)
    if item is _END:
        return []
    return joined([item, *stream.take_ready()])  # what waits goes out together


def joined(items: list[StreamItem]) -> list[StreamItem]:
    """``items`` with each run of consecutive text pieces joined into one: a stream that fell behind
    the engine (several tokens waiting) is sent as one content chunk instead of one per token."""
    out: list[StreamItem] = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        else:
            out.append(item)
    return out


class FinalRecorder(Protocol):
    """What :func:`stream_events` tells of each finished choice (the server's metrics recorder)."""

    def final(self, choice: int, final: Mapping[str, Any]) -> None: ...


async def stream_events(stream: AsyncStream[StreamItem], drain: Drain, record: FinalRecorder,
                        is_list: bool = False, n: int = 1) -> AsyncIterator[Event]:
    """Every item of ``stream`` as a normalized :class:`Event` (``event(item, is_list, n)``), read
    in bursts by :func:`next_items`; each choice's final goes to ``record.final`` once its event was
    consumed. Raises :class:`ShuttingDown`, or what the stream raises (the caller writes the error
    event in its protocol's shape)."""
    while batch := await next_items(stream, drain):
        for one in batch:
            ev = event(one, is_list, n)
            yield ev
            if ev.final is not None:
                record.final(ev.choice, ev.final)
