"""Caller side of a request: preprocessing, submitting, reading the channel, streams,
postprocessing; and ``LocalClient``, the client contract over an in-process runtime.

Everything here runs in the caller's thread (or event loop); the executor threads only run the
backend. A caller that leaves (exception, cancellation, closed stream) withdraws its request; a
deadline turns into ``DeadlineExceeded``.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any, Generic, NoReturn, Protocol, Self, TypeVar, cast

import anyio

from ._batch import Batch
from ._channel import END
from ._messages import Part, RowEvent
from ._output import Output, concat_outputs, slice_output
from ._request import Request, check_deadline
from ._backend import Backend, IterativeBackend
from ._telemetry import Callback, ServingStats, timed

__all__ = ["AsyncStream", "Consumer", "LocalClient", "ServingSpec", "Stream", "Transducer"]

In = TypeVar("In")  # what a caller passes (``run(input)``)
Out = TypeVar("Out")  # what a call returns (the postprocessed result)
T = TypeVar("T")  # one stream item


In_contra = TypeVar("In_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)


class ServingSpec(Protocol[In_contra, Out_co]):
    """What the client side and the runtimes read of a ``Serving`` (its description, not its
    verbs): the backend and its ``init`` argument, the telemetry callback, and the caller-side
    steps. ``Serving`` satisfies it; this module, ``_handle`` and ``_inline`` depend on this
    protocol, not on ``_serving`` (which imports them)."""

    @property
    def _backend(self) -> Backend | IterativeBackend: ...
    @property
    def _arg(self) -> object: ...
    @property
    def _telemetry(self) -> Callback | None: ...
    @property
    def _is_iterative(self) -> bool: ...
    def _preprocess(self, input: In_contra) -> tuple[Batch, object]: ...
    def _offload(self, input: In_contra) -> bool: ...
    def _postprocess(self, result: tuple[Any, Any], info: object) -> Out_co: ...
    def _transducer_for(self, info: object) -> Transducer[Any]: ...


class Transducer(Protocol[T]):
    """Client-side state of one iterative request, built by ``Serving.streaming(factory)``.

    ``feed(row_index, event)`` turns one backend event of row ``row_index`` (0-based within the
    request) into items for the caller; ``stop_rows()`` names rows to cancel now (e.g. a stop
    string was found), asked after every ``feed``; ``close()`` returns the last items when every
    row finished or stopped.

    Optional attribute ``live`` (default True): False promises that ``stop_rows()`` never names a
    row, so a non-streamed call may receive all its events in one burst at the end instead of
    waking its caller once per event, and ``stop_rows()`` is then not asked.
    """

    def feed(self, row_index: int, event: Any) -> list[T]: ...

    def stop_rows(self) -> list[int]: ...

    def close(self) -> list[T]: ...


class EventTransducer:
    """Default transducer: each event becomes the item ``(row_index, event)``."""

    def feed(self, row_index: int, event: object) -> list[tuple[int, object]]:
        return [(row_index, event)]

    def stop_rows(self) -> list[int]:
        return []

    def close(self) -> list[tuple[int, object]]:
        return []


class Consumer(Protocol[T]):
    """Turns a request's channel messages into caller items (``T``), and the items into a result."""

    live: bool

    def on_message(self, message: object) -> list[T]: ...

    def finish(self) -> list[T]: ...

    def result(self, items: list[T]) -> Any: ...  # a local call: (output, metadata); a pool's: the result


class StaticConsumer:
    """Reads ``Part`` messages: each is a slice of a batch output holding this caller's rows."""

    live = True

    def __init__(self) -> None:
        self._parts: list[tuple[int, Output, object]] = []

    def on_message(self, message: object) -> list[tuple[object, object]]:
        message = cast(Part, message)
        piece = slice_output(message.output, message.start, message.size)
        self._parts.append((message.offset, piece, message.metadata))
        return [(piece, message.metadata)]

    def finish(self) -> list[tuple[object, object]]:
        return []

    def result(self, items: list[tuple[object, object]]) -> tuple[object, object]:
        """``(output, metadata)``: pieces joined in row order; metadata of the first piece."""
        parts = sorted(self._parts, key=lambda p: p[0])
        return concat_outputs([p[1] for p in parts]), parts[0][2]


class IterativeConsumer:
    """Feeds ``RowEvent`` messages to the transducer and forwards its stop requests."""

    def __init__(self, request: Request, transducer: Transducer[Any]):
        self._request, self._transducer = request, transducer
        self._stopped: set[int] = set()
        self.live: bool = getattr(transducer, "live", True)

    def on_message(self, message: object) -> list[object]:
        message = cast(RowEvent, message)
        row = message.row
        if row in self._stopped:
            return []
        items = self._transducer.feed(row, message.event)
        if self.live:  # else stop_rows() never names a row (the Transducer's promise)
            self._forward_stops()
        return items

    def _forward_stops(self) -> None:
        stops = [i for i in self._transducer.stop_rows() if i not in self._stopped]
        if stops:
            self._stopped.update(stops)
            self._request.stop_rows(stops)

    def finish(self) -> list[object]:
        return list(self._transducer.close())

    def result(self, items: list[object]) -> tuple[list[object], None]:
        return items, None


def _next_messages(request: Request) -> list[object]:
    """Every message that has arrived (waiting for the first), as ``Channel.get_all``; past the
    deadline the request expires (its close error is raised)."""
    try:
        return request.channel.get_all(request.remaining())
    except TimeoutError:
        request.expire()
        return request.channel.get_all(0)


async def _anext_messages(request: Request) -> list[object]:
    """Async ``_next_messages``."""
    remaining = request.remaining()
    if remaining is None:
        return await request.channel.aget_all()
    with anyio.move_on_after(remaining):
        return await request.channel.aget_all()
    request.expire()
    return request.channel.get_all(0)


class _StreamBase(Generic[T]):
    """State shared by ``Stream`` and ``AsyncStream``: the request, its consumer, the messages
    taken from the channel in one burst and not consumed yet, pending items.

    Iteration consumes one message at a time, when the items before it are gone (so a
    consumer's error or stop request comes exactly where it would reading message by message);
    only the channel reads are batched (one lock round and one wake-up per burst)."""

    def __init__(self, request: Request, consumer: Consumer[T]):
        self._request, self._consumer = request, consumer
        self._messages: deque[object] = deque()
        self._pending: deque[T] = deque()
        self._finished = False

    @property
    def request_id(self) -> int:
        """The request's id (also on every ``ServingError`` it ends with)."""
        return self._request.id

    def _absorb_next(self) -> None:
        """The oldest taken message -> pending items (``END``: the consumer's last ones)."""
        message = self._messages.popleft()
        if message is END:
            self._pending.extend(self._consumer.finish())
            self._finished = True
        else:
            self._pending.extend(self._consumer.on_message(message))

    def _absorb_taken(self) -> None:
        """Every taken message -> pending items (up to and including ``END``)."""
        while self._messages and not self._finished:
            self._absorb_next()

    def _take_pending(self) -> list[T]:
        items = list(self._pending)
        self._pending.clear()
        return items

    def close(self) -> None:
        """Stop reading; the request is withdrawn if it has not finished. Never blocks."""
        self._withdraw()

    def _withdraw(self) -> None:
        """Cancel the request; once its channel failed, the messages taken and not consumed go
        too (the channel drops its unread ones at a failure), so reading on raises the failure
        as reading message by message would."""
        self._request.cancel()
        if self._request.channel.failed:
            self._messages.clear()

    def __del__(self) -> None:
        request = getattr(self, "_request", None)
        if request is not None and not request.done:
            warnings.warn(f"{type(self).__name__} of request {request.id} was dropped unclosed; close it "
                          "(or use it as a context manager)", ResourceWarning, stacklevel=1, source=self)
            request.cancel_later()


class Stream(_StreamBase[T]):
    """Sync iterator over one request's items, submitted when the stream was made.

    Close it (``close()``, ``with``, or iterate to the end): closing early withdraws the request.
    A stream dropped unclosed warns (``ResourceWarning``) and is withdrawn by its owner at the
    next scheduling point. Raises what the request ended with: ``DeadlineExceeded``,
    ``BackendError``, ... (each with ``request_id``).
    """

    def __iter__(self) -> Stream[T]:
        return self

    def __next__(self) -> T:
        try:
            while not self._pending:
                if self._finished:
                    raise StopIteration
                if not self._messages:
                    self._messages.extend(_next_messages(self._request))
                self._absorb_next()
        except StopIteration:
            raise
        except BaseException:
            self._withdraw()
            raise
        return self._pending.popleft()

    def _read_to_end(self) -> list[T]:
        """Every item left, for a call's whole result (a burst of messages per wait, not one
        item per ``next``)."""
        while not self._finished:
            self._messages.extend(_next_messages(self._request))
            self._absorb_taken()
        return self._take_pending()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream(_StreamBase[T]):
    """Async iterator (asyncio or trio) over one request's items, submitted when the stream was
    made. ``aclose()``, ``async with``, or the reading task being cancelled withdraws the
    request. A plain ``for`` over it raises ``TypeError`` (it would block the event loop)."""

    def __iter__(self) -> NoReturn:
        raise TypeError("AsyncStream is an async iterator: use 'async for' (a blocking 'for' would "
                        "hold the event loop); use stream() for a sync iterator")

    def __aiter__(self) -> AsyncStream[T]:
        return self

    async def __anext__(self) -> T:
        try:
            while not self._pending:
                if self._finished:
                    raise StopAsyncIteration
                if not self._messages:
                    self._messages.extend(await _anext_messages(self._request))
                self._absorb_next()
        except StopAsyncIteration:
            raise
        except BaseException:
            self._withdraw()
            raise
        return self._pending.popleft()

    async def _aread_to_end(self) -> list[T]:
        """Async ``Stream._read_to_end``."""
        while not self._finished:
            self._messages.extend(await _anext_messages(self._request))
            self._absorb_taken()
        return self._take_pending()

    def take_ready(self) -> list[T]:
        """The items that have already arrived, in order, without waiting (``[]`` when none has):
        for a writer that sends, after each awaited item, everything else already there in one
        write. Raises what the request ended with, as iteration would (the request is withdrawn
        then); after the last item, iteration stops."""
        try:
            self._absorb_taken()
            if not self._finished:
                self._messages.extend(self._request.channel.take_ready())
                self._absorb_taken()
        except BaseException:
            self._withdraw()
            raise
        return self._take_pending()

    async def aclose(self) -> None:
        """Stop reading; the request is withdrawn if it has not finished."""
        self.close()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Runtime(Protocol):
    """Where a local client submits requests: a scheduler or the inline runtime."""

    def submit(self, request: Request, batch: Batch) -> None: ...

    def stats(self) -> ServingStats: ...


class Call(Generic[Out]):
    """One submitted call of a serving: its request and consumer; reads and postprocesses."""

    def __init__(self, serving: ServingSpec[Any, Out], runtime: Runtime, prepared: tuple[Batch, object],
                 deadline: float | None):
        batch, self.info = prepared
        self.serving = serving
        self.request = Request(batch.size, deadline)
        if serving._is_iterative:
            self.consumer: Consumer[Any] = IterativeConsumer(self.request, serving._transducer_for(self.info))
        else:
            self.consumer = StaticConsumer()
        runtime.submit(self.request, batch)

    def _hold_unless_live(self) -> None:
        if not self.consumer.live:
            self.request.channel.hold_until_close()

    def result(self) -> Out:
        """Block until done; the postprocessed result."""
        self._hold_unless_live()
        with Stream(self.request, self.consumer) as stream:
            items = stream._read_to_end()
        return self._postprocess(items)

    async def result_async(self) -> Out:
        """Await completion without blocking the event loop; the postprocessed result."""
        self._hold_unless_live()
        async with AsyncStream(self.request, self.consumer) as stream:
            items = await stream._aread_to_end()
        return self._postprocess(items)

    def _postprocess(self, items: list[Any]) -> Out:
        with timed(self.serving._telemetry, "postprocessing", self.request.size):
            return self.serving._postprocess(self.consumer.result(items), self.info)


class LocalClient(Generic[In, Out]):
    """The client contract (see ``Client``) over a runtime in this process.

    Subclasses set ``_serving`` and implement ``_runtime()`` (raising ``ServingStopped`` when
    closed), ``_check(batch)``, ``stats()`` and ``close()``.
    """

    _serving: ServingSpec[In, Out]

    def _runtime(self) -> Runtime:
        raise NotImplementedError

    def _check(self, batch: Batch) -> None:
        """Refuse a batch this runtime cannot take (e.g. an unknown batch key)."""

    def stats(self) -> ServingStats:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _prepare(self, input: In, deadline: float | None) -> tuple[Batch, object]:
        check_deadline(deadline)  # before preprocessing: a bad deadline wastes no tokenization
        prepared = self._serving._preprocess(input)
        self._check(prepared[0])
        return prepared

    async def _prepare_async(self, input: In, deadline: float | None) -> tuple[Batch, object]:
        if self._serving._offload(input):
            return await anyio.to_thread.run_sync(self._prepare, input, deadline)
        return self._prepare(input, deadline)

    def _call(self, prepared: tuple[Batch, object], deadline: float | None) -> Call[Out]:
        return Call(self._serving, self._runtime(), prepared, deadline)

    def run(self, input: In, *, deadline: float | None = None) -> Out:
        """Run one request; blocks; the postprocessed result."""
        return self._call(self._prepare(input, deadline), deadline).result()

    async def run_async(self, input: In, *, deadline: float | None = None) -> Out:
        """``run`` for asyncio/trio: awaits without blocking the loop; cancelling it withdraws."""
        return await self._call(await self._prepare_async(input, deadline), deadline).result_async()

    def stream(self, input: In, *, deadline: float | None = None) -> Stream[Any]:
        """Submit now; a ``Stream`` of items as they arrive (iterative: transducer items;
        static: ``(output, metadata)`` per executed chunk)."""
        call = self._call(self._prepare(input, deadline), deadline)
        return Stream(call.request, call.consumer)

    async def stream_async(self, input: In, *, deadline: float | None = None) -> AsyncStream[Any]:
        """Submit now (preprocessing off the loop when the serving says so); an ``AsyncStream``."""
        call = self._call(await self._prepare_async(input, deadline), deadline)
        return AsyncStream(call.request, call.consumer)

    async def aclose(self) -> None:
        """``close`` off the event loop."""
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

