"""Per-request channel: the executor thread puts messages, the caller takes them (sync or async).

A channel is closed once, either normally (after its last message) or with an error. Readers see
every message put before the close, then the end (``END``) or the error. Any thread may put or
close; readers may block a thread (``get``, ``get_all``) or await under asyncio or trio (``aget``,
``aget_all``): async readers are woken with the event loop's thread-safe "call soon", never by
blocking the writer. The ``_all`` readers take every message that has arrived in one call (one
lock round and one wake-up for a burst, e.g. a decode step's tokens that queued while the reader
worked). A writer that puts on many channels at once (the iterative scheduler, after a decode
step) passes a ``deferred`` list to ``put`` / ``close`` and then calls :func:`wake`: one "call
soon" per event loop instead of one per channel.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
import sniffio

END: Any = object()  # returned by get/aget after the last message of a normally closed channel


RunSoon = Callable[[Callable[[], None]], object]  # an event loop's thread-safe "call soon" (result unused)
Waker = tuple[RunSoon, Callable[[], None]]  # (the reader's loop, the callback that wakes it)
M = TypeVar("M")  # a message


def _waiter() -> tuple[Waker, Awaitable[Any]]:
    """A wake-up for the current task and what it awaits until then: under asyncio a bare
    future of the running loop (the cheapest wait: no anyio Event, one sniffio look-up), under
    trio an anyio Event."""
    if sniffio.current_async_library() == "trio":
        import trio

        event = anyio.Event()
        return (trio.lowlevel.current_trio_token().run_sync_soon, event.set), event.wait()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    return (loop.call_soon_threadsafe, functools.partial(_resolve, future)), future


def _resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result(None)


def wake(wakers: list[Waker]) -> None:
    """Run wake-ups that ``Channel.put(..., deferred)`` collected: one "call soon" per event
    loop (a thread-safe call soon writes to the loop's wake-up pipe), whatever the number of
    channels; call holding no channel lock."""
    by_loop: dict[RunSoon, list[Callable[[], None]]] = {}
    for run_soon, fn in wakers:
        by_loop.setdefault(run_soon, []).append(fn)
    for run_soon, fns in by_loop.items():
        _call_soon(run_soon, fns[0] if len(fns) == 1 else functools.partial(_call_all, fns))


def _call_all(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()


def _call_soon(run_soon: RunSoon, fn: Callable[[], None]) -> None:
    try:
        run_soon(fn)
    except RuntimeError:  # loop closed (asyncio) or run finished (trio.RunFinishedError)
        pass


class Channel(Generic[M]):
    """Unbounded per-request message queue; its length is bounded by the request's own output.
    ``Channel[M]``: the readers get ``M`` messages (and ``END``)."""

    __slots__ = ("_lock", "_cond", "_items", "_closed", "_error", "_wakers", "_quiet", "_blocked")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken directly (Condition's own __enter__ is a Python call)
        self._cond = threading.Condition(self._lock)
        self._items: deque[M] = deque()
        self._closed = False
        self._error: BaseException | None = None
        self._wakers: list[Waker] = []
        self._quiet = False
        self._blocked = 0  # threads waiting in get / get_all: only then does a put notify

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """Closed with an error."""
        return self._error is not None

    def hold_until_close(self) -> None:
        """From now on readers wake only at the close and then take every message at once: for
        callers that want the whole result, this saves one thread or event-loop wake-up per
        message (per generated token, for text generation)."""
        with self._lock:
            self._quiet = True

    def _ready(self) -> bool:
        return self._closed or (bool(self._items) and not self._quiet)

    def put(self, item: M, deferred: list[Waker] | None = None) -> bool:
        """Append a message; False (dropped) once the channel is closed. With ``deferred``, the
        async readers' wake-ups are appended there for the caller to run with :func:`wake` once
        it has put a batch of messages on many channels (blocked threads are notified at once)."""
        with self._lock:
            if self._closed:
                return False
            self._items.append(item)
            if not self._quiet:
                self._wake(deferred)
        return True

    def close(self, error: BaseException | None = None, deferred: list[Waker] | None = None) -> bool:
        """Close normally or with ``error``; True for the call that closed it. ``deferred``: as
        for :meth:`put`."""
        with self._lock:
            if self._closed:
                return False
            self._closed, self._error = True, error
            if error is not None:
                self._items.clear()
            self._wake(deferred)
        return True

    def _wake(self, deferred: list[Waker] | None = None) -> None:
        if self._blocked:
            self._cond.notify_all()
        if not self._wakers:
            return
        wakers, self._wakers = self._wakers, []
        if deferred is not None:
            deferred.extend(wakers)
            return
        for run_soon, fn in wakers:
            _call_soon(run_soon, fn)

    def _take(self) -> M:
        if self._items:
            return self._items.popleft()
        if self._error is not None:
            raise self._error
        return END

    def _take_all(self) -> list[M]:
        items = list(self._items)
        self._items.clear()
        if self._closed:
            if self._error is not None:
                raise self._error  # close(error) cleared the messages
            items.append(END)
        return items

    def _wait_ready(self, timeout: float | None) -> None:
        """Wait (lock held) until a reader may take; ``TimeoutError`` after ``timeout`` s."""
        if self._ready():
            return
        self._blocked += 1
        try:
            if not self._cond.wait_for(self._ready, timeout):
                raise TimeoutError
        finally:
            self._blocked -= 1

    def get(self, timeout: float | None = None) -> M:
        """Next message, ``END``, or raise the close error; ``TimeoutError`` after ``timeout`` s."""
        with self._lock:
            self._wait_ready(timeout)
            return self._take()

    def get_all(self, timeout: float | None = None) -> list[M]:
        """``get`` for every message that has arrived: waits for the first, returns them all in
        order, followed by ``END`` once the channel closed normally (``[END]`` after the last);
        raises the close error when it closed with one; ``TimeoutError`` after ``timeout`` s."""
        with self._lock:
            self._wait_ready(timeout)
            return self._take_all()

    def take_ready(self) -> list[M]:
        """Every message that has arrived, without waiting (``[]`` when none has, or while held
        until close), followed by ``END`` once the channel closed normally; raises the close
        error, as ``get`` does, when the channel closed with one."""
        with self._lock:
            return self._take_all() if self._ready() else []

    async def aget(self) -> M:
        """Async ``get``: waits without blocking the event loop (asyncio or trio). A waiter
        that is cancelled removes its wake-up callback (as trio's ``abort_fn`` does)."""
        return await self._await(self._take)

    async def aget_all(self) -> list[M]:
        """Async ``get_all`` (every message that has arrived, see there), waiting as ``aget``."""
        return await self._await(self._take_all)

    async def _await(self, take: Callable[[], Any]) -> Any:
        while True:
            with self._lock:
                if self._ready():
                    return take()
                waker, wakeup = _waiter()
                self._wakers.append(waker)
            try:
                await wakeup
            except BaseException:
                self._forget(waker)  # cancelled: remove its wake-up (a normal wake-up took it)
                raise

    def _forget(self, waker: Waker) -> None:
        with self._lock:
            try:
                self._wakers.remove(waker)
            except ValueError:
                pass  # already taken by _wake

    def waiters(self) -> int:
        """Async readers registered for a wake-up (for tests and statistics)."""
        with self._lock:
            return len(self._wakers)
