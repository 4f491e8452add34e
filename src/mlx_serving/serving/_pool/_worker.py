"""The worker process of a `ServingPool`.

``main`` runs in a process started with the spawn method. It builds the serving with the pool's
factory, starts it in process mode (``Serving.start``), reports `Ready` (or `StartFailed`), then
serves calls on an asyncio loop: one task per call, so concurrent calls batch together inside the
worker's serving. A `Cancel` cancels the call's task (the serving drops or stops the request); a
`Shutdown` lets running calls finish, then stops the serving; the parent going away (end of stream)
cancels everything and exits.

The same loop sends a `Heartbeat` every ``heartbeat_interval`` seconds, from its first turn until
it exits, so the parent can tell a worker whose loop stopped (the process stopped, a native call
holding the GIL, the loop thread blocked) from one that is busy: a backend runs on the serving's
executor threads, and the loop keeps beating meanwhile. SIGUSR1 makes the worker write every
thread's Python stack to its stderr (``faulthandler``, which works even while another thread holds
the GIL); the parent sends it to a worker it is about to kill for missing heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import importlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from .._errors import ServingStopped
from ._remote import error_info
from ._wire import (
    Call,
    Cancel,
    End,
    Failed,
    FromWorker,
    Heartbeat,
    Item,
    Ready,
    Result,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    decode_payload,
    decode_to_worker,
    encode_message,
    encode_payload,
    recv_frame,
    send_frame,
)

__all__ = ["main", "resolve_factory"]

Factory = str | Callable[[], Any]


def resolve_factory(factory: Factory) -> Callable[[], Any]:
    """The callable behind ``factory``: itself, or the object named by ``"package.module:attr"``.

    Raises ValueError for a malformed import path, ImportError / AttributeError if it does not
    resolve, TypeError if the result is not callable.
    """
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"factory import path must look like 'package.module:function', got {factory!r}")
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
        factory = target
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    return factory


def main(sock: socket.socket, factory: Factory, process_options: dict[str, Any],
         heartbeat_interval: float = 1.0) -> None:
    """Process entry point: start the serving, report, serve until shutdown or parent exit."""
    with contextlib.suppress(Exception):  # no usable stderr, or no SIGUSR1 on this platform
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        handle = _start(factory, process_options)
    except BaseException as exc:
        _send(sock, StartFailed(error_info(exc)))
        sock.close()
        sys.exit(1)
    _send(sock, Ready(os.getpid()))
    asyncio.run(_Worker(sock, handle, heartbeat_interval).serve())
    sock.close()


def _start(factory: Factory, process_options: dict[str, Any]) -> Any:
    from .._serving import Serving

    serving = resolve_factory(factory)()
    if not isinstance(serving, Serving):
        raise TypeError(f"the pool factory must return a Serving, got {type(serving).__name__}")
    return Serving.start(serving, **process_options)


def _send(sock: socket.socket, message: FromWorker) -> None:
    """Send to the parent; a parent that is gone is noticed by the reader (end of stream)."""
    try:
        send_frame(sock, encode_message(message))
    except OSError:
        pass


class _Worker:
    """Dispatches the parent's messages to one task per call; all sends happen on the loop."""

    def __init__(self, sock: socket.socket, handle: Any, heartbeat_interval: float) -> None:
        self._sock = sock
        self._handle = handle
        self._heartbeat_interval = heartbeat_interval
        self._tasks: dict[int, asyncio.Task[None]] = {}

    async def serve(self) -> None:
        frames: asyncio.Queue[bytearray | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop, frames), daemon=True).start()
        beat = asyncio.create_task(self._beat())
        try:
            while True:
                frame = await frames.get()
                if frame is None:  # the parent is gone: nobody waits for answers
                    await self._stop(0.0, report=False)
                    return
                message = decode_to_worker(frame)
                if isinstance(message, Shutdown):
                    await self._stop(message.timeout, report=True)
                    return
                self._dispatch(message)
        finally:
            beat.cancel()

    async def _beat(self) -> None:
        """Tell the parent that this loop runs, until the worker exits (Shutdown included)."""
        heartbeat = encode_message(Heartbeat())
        while True:
            try:
                send_frame(self._sock, heartbeat)
            except OSError:
                return  # the parent is gone; the reader thread reports it
            await asyncio.sleep(self._heartbeat_interval)

    def _read(self, loop: asyncio.AbstractEventLoop, frames: asyncio.Queue[bytearray | None]) -> None:
        while True:
            try:
                frame = recv_frame(self._sock)
            except OSError:
                frame = None
            try:
                loop.call_soon_threadsafe(frames.put_nowait, frame)
            except RuntimeError:  # the loop has finished
                return
            if frame is None:
                return

    def _dispatch(self, message: Call | Cancel | StatsQuery) -> None:
        if isinstance(message, Call):
            self._tasks[message.id] = asyncio.create_task(self._call(message))
        elif isinstance(message, Cancel):
            task = self._tasks.pop(message.id, None)
            if task is not None:
                # after the task's first step, which submits the call to the serving (unless its
                # preprocessing is offloaded): the serving then counts it as cancelled, even when
                # the Cancel came right behind the Call
                asyncio.get_running_loop().call_soon(task.cancel)
        else:
            stats = msgspec.to_builtins(self._handle.stats())
            _send(self._sock, StatsReply(message.id, stats))

    async def _call(self, call: Call) -> None:
        try:
            value = decode_payload(call.payload)
            if call.stream:
                async with await self._handle.stream_async(value, deadline=call.deadline) as stream:
                    async for item in stream:
                        _send(self._sock, Item(call.id, encode_payload(item)))
                _send(self._sock, End(call.id))
            else:
                result = await self._handle.run_async(value, deadline=call.deadline)
                _send(self._sock, Result(call.id, encode_payload(result)))
        except asyncio.CancelledError:
            pass  # the caller left (Cancel) or the worker is stopping (answered by _stop)
        except Exception as exc:
            _send(self._sock, Failed(call.id, error_info(exc)))
        finally:
            if self._tasks.get(call.id) is asyncio.current_task():
                del self._tasks[call.id]

    async def _stop(self, timeout: float, report: bool) -> None:
        """Let running calls finish for up to ``timeout`` s, fail the rest, stop the serving."""
        if self._tasks and timeout > 0:
            await asyncio.wait(list(self._tasks.values()), timeout=timeout)
        left = dict(self._tasks)
        for task in left.values():
            task.cancel()
        await asyncio.gather(*left.values(), return_exceptions=True)
        if report:
            for call_id in left:
                stopped = ServingStopped(f"the pool worker stopped before request {call_id} finished")
                _send(self._sock, Failed(call_id, error_info(stopped)))
        await asyncio.to_thread(self._handle.close)
