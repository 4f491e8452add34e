"""Caller side of a request: preprocessing, reading the channel, streams, postprocessing.

Everything here runs in the caller's thread (or event loop); the executor threads only run the
backend. A caller that leaves (exception, cancellation, closed or collected stream) withdraws its
request; a deadline turns into ``DeadlineExceeded``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import anyio

from ._batch import Batch
from ._channel import END
from ._output import concat_outputs, slice_output
from ._request import Request, reap_orphans
from ._telemetry import Callback, timed

__all__ = ["AsyncStream", "Stream", "Transducer"]


class Transducer(Protocol):
    """Client-side state of one iterative request, built by ``Serving.streaming(factory)``.

    ``feed(row_index, event)`` turns one backend event of row ``row_index`` (0-based within the
    request) into items for the caller; ``stop_rows()`` names rows to cancel now (e.g. a stop
    string was found), asked after every ``feed``; ``close()`` returns the last items when every
    row finished or stopped.

    Optional attribute ``live`` (default True): False promises that ``stop_rows()`` never names a
    row, so a non-streamed call may receive all its events in one burst at the end instead of
    waking its caller once per event.
    """

    def feed(self, row_index: int, event: Any) -> list[Any]: ...

    def stop_rows(self) -> list[int]: ...

    def close(self) -> list[Any]: ...


class EventTransducer:
    """Default transducer: each event becomes the item ``(row_index, event)``."""

    def feed(self, row_index: int, event: Any) -> list[Any]:
        return [(row_index, event)]

    def stop_rows(self) -> list[int]:
        return []

    def close(self) -> list[Any]:
        return []


class StaticConsumer:
    """Reads ``part`` messages: each is a slice of a batch output holding this caller's rows."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, Any, Any]] = []

    def on_message(self, message: tuple[Any, ...]) -> list[Any]:
        _, offset, output, metadata, start, size = message
        piece = slice_output(output, start, size)
        self._parts.append((offset, piece, metadata))
        return [(piece, metadata)]

    def finish(self) -> list[Any]:
        return []

    def result(self, items: list[Any]) -> tuple[Any, Any]:
        """``(output, metadata)``: pieces joined in row order; metadata of the first piece."""
        parts = sorted(self._parts, key=lambda p: p[0])
        return concat_outputs([p[1] for p in parts]), parts[0][2]


class IterativeConsumer:
    """Feeds ``event`` messages to the transducer and forwards its stop requests."""

    def __init__(self, request: Request, transducer: Transducer):
        self._request, self._transducer = request, transducer
        self._stopped: set[int] = set()
        self.live: bool = getattr(transducer, "live", True)

    def on_message(self, message: tuple[Any, ...]) -> list[Any]:
        _, index, event = message
        if index in self._stopped:
            return []
        items = list(self._transducer.feed(index, event))
        stops = [i for i in self._transducer.stop_rows() if i not in self._stopped]
        if stops:
            self._stopped.update(stops)
            self._request.stop_rows(stops)
        return items

    def finish(self) -> list[Any]:
        return list(self._transducer.close())

    def result(self, items: list[Any]) -> tuple[Any, Any]:
        return items, None


Consumer = StaticConsumer | IterativeConsumer


def _next_message(request: Request) -> Any:
    try:
        return request.channel.get(request.remaining())
    except TimeoutError:
        request.expire()
        return request.channel.get(0)


async def _anext_message(request: Request) -> Any:
    remaining = request.remaining()
    if remaining is None:
        return await request.channel.aget()
    with anyio.move_on_after(remaining):
        return await request.channel.aget()
    request.expire()
    return request.channel.get(0)


class Stream:
    """Sync iterator over one request's items; closing it (or dropping it) cancels the request.

    Raises what the request ended with: ``DeadlineExceeded``, ``BackendError``, ... .
    """

    def __init__(self, request: Request, consumer: Consumer):
        self._request, self._consumer = request, consumer
        self._pending: deque[Any] = deque()
        self._finished = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        try:
            while not self._pending:
                if self._finished:
                    raise StopIteration
                self._absorb(_next_message(self._request))
        except StopIteration:
            raise
        except BaseException:
            self._request.cancel()
            raise
        return self._pending.popleft()

    def _absorb(self, message: Any) -> None:
        if message is END:
            self._pending.extend(self._consumer.finish())
            self._finished = True
        else:
            self._pending.extend(self._consumer.on_message(message))

    def close(self) -> None:
        """Stop reading; the request is withdrawn if it has not finished."""
        self._request.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        request = getattr(self, "_request", None)
        if request is not None:
            request.cancel_later()


class AsyncStream(Stream):
    """Async iterator twin of ``Stream`` (asyncio or trio); ``aclose()`` or dropping it cancels."""

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Any:
        try:
            while not self._pending:
                if self._finished:
                    raise StopAsyncIteration
                self._absorb(await _anext_message(self._request))
        except StopAsyncIteration:
            raise
        except BaseException:
            self._request.cancel()
            raise
        return self._pending.popleft()

    async def aclose(self) -> None:
        """Stop reading; the request is withdrawn if it has not finished."""
        self.close()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class Call:
    """One call of a serving: preprocess, submit to ``runtime``, read, postprocess."""

    def __init__(self, serving: Any, runtime: Any, input: Any, deadline: float | None,
                 check_key: Callable[[Batch], None] | None = None):
        reap_orphans()
        telemetry: Callback | None = serving._telemetry
        with timed(telemetry, "preprocessing", 0):
            batch, self.info = serving._preprocess(input)
        if check_key is not None:
            check_key(batch)
        self.serving = serving
        self.request = Request(batch.size, deadline)
        if serving._is_iterative:
            self.consumer: Consumer = IterativeConsumer(self.request, serving._transducer_for(self.info))
        else:
            self.consumer = StaticConsumer()
        runtime.submit(self.request, batch)

    def _hold_unless_live(self) -> None:
        if isinstance(self.consumer, IterativeConsumer) and not self.consumer.live:
            self.request.channel.hold_until_close()

    def result(self) -> Any:
        """Block until done; the postprocessed result."""
        self._hold_unless_live()
        items = list(Stream(self.request, self.consumer))
        return self._postprocess(items)

    async def result_async(self) -> Any:
        """Await completion without blocking the event loop; the postprocessed result."""
        self._hold_unless_live()
        items = [item async for item in AsyncStream(self.request, self.consumer)]
        return self._postprocess(items)

    def _postprocess(self, items: list[Any]) -> Any:
        with timed(self.serving._telemetry, "postprocessing", self.request.size):
            return self.serving._postprocess(self.consumer.result(items), self.info)

    def stream(self) -> Stream:
        return Stream(self.request, self.consumer)

    def stream_async(self) -> AsyncStream:
        return AsyncStream(self.request, self.consumer)
