"""The Ray actor of a ``RayBackend`` (a ``ServingPool`` over Ray): one started Serving per actor.

The actor is an async actor (its methods run as tasks on one asyncio loop inside the actor), so
concurrent calls routed to it batch together inside its serving, exactly as the calls of one
process-pool worker do. ``call`` answers one request (``run_async``); ``stream`` is a streaming
generator (``num_returns="streaming"``) over ``stream_async``; ``cancel`` cancels a call's task by
the caller's request id, so the serving drops its queued rows or stops its running rows.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from .._errors import ServingStopped
from .._telemetry import ServingStats

__all__ = ["ServingActor"]

_EARLY_CANCELS = 4096  # cancels remembered for calls that have not started yet (bounded)


class ServingActor:
    """Builds the serving with the pool's factory and starts it (``Serving.start``)."""

    def __init__(self, factory: bytes, process_options: dict[str, Any], sys_path: list[str]) -> None:
        # the caller's sys.path entries that exist here (same host: the factory's module imports
        # as in a process-pool worker; on another host, use ray_actor_options' runtime_env)
        for entry in sys_path:
            if entry not in sys.path and os.path.isdir(entry or "."):
                sys.path.append(entry)
        self._tasks: dict[int, asyncio.Task[Any]] = {}
        self._early: OrderedDict[int, None] = OrderedDict()
        self._stopping = False
        # a failed start is kept and raised by ready(): an exception raised here would reach the
        # caller only as the text of Ray's ActorDiedError, not as itself
        self._start_error: Exception | None = None
        self._handle: Any = None
        try:
            self._handle = _start(factory, process_options)
        except Exception as exc:
            self._start_error, self._stopping = exc, True

    async def ready(self) -> int:
        """The actor's process id (a restarted actor answers with its new one); raises what the
        factory or ``Serving.start`` raised."""
        if self._start_error is not None:
            raise self._start_error
        return os.getpid()

    def _enter(self, call_id: int) -> bool:
        """Register the running task under ``call_id``; False if it was cancelled already."""
        if call_id in self._early:
            del self._early[call_id]
            return False
        if self._stopping:
            raise ServingStopped("the Ray pool actor is stopping")
        task = asyncio.current_task()
        assert task is not None
        self._tasks[call_id] = task
        return True

    def _leave(self, call_id: int) -> None:
        if self._tasks.get(call_id) is asyncio.current_task():
            del self._tasks[call_id]

    async def call(self, call_id: int, value: object, deadline: float | None) -> object:
        """One request: ``run_async`` on the serving (None when cancelled before it started)."""
        if not self._enter(call_id):
            return None
        try:
            return await self._handle.run_async(value, deadline=deadline)
        except asyncio.CancelledError:
            if self._stopping:  # cancelled by shutdown, not by its caller
                raise ServingStopped(f"the Ray pool actor stopped before request {call_id} finished") from None
            raise
        finally:
            self._leave(call_id)

    async def stream(self, call_id: int, value: object, deadline: float | None) -> AsyncIterator[object]:
        """Streaming generator: the items of ``stream_async`` on the serving."""
        if not self._enter(call_id):
            return
        try:
            async with await self._handle.stream_async(value, deadline=deadline) as stream:
                async for item in stream:
                    yield item
        except asyncio.CancelledError:
            if self._stopping:
                raise ServingStopped(f"the Ray pool actor stopped before request {call_id} finished") from None
            raise
        finally:
            self._leave(call_id)

    async def cancel(self, call_id: int) -> None:
        """The caller withdrew ``call_id``: cancel its task (the serving withdraws the rows)."""
        task = self._tasks.pop(call_id, None)
        if task is not None:
            task.cancel()
            return
        self._early[call_id] = None
        while len(self._early) > _EARLY_CANCELS:
            self._early.popitem(last=False)

    async def stats(self) -> ServingStats:
        """The serving's ``ServingStats``."""
        return self._handle.stats()

    async def shutdown(self, timeout: float) -> list[int]:
        """Refuse new calls, let running ones finish (up to ``timeout`` s), cancel the rest and
        stop the serving. Returns the ids of the calls it cancelled."""
        self._stopping = True
        if self._tasks and timeout > 0:
            await asyncio.wait(list(self._tasks.values()), timeout=timeout)
        left = dict(self._tasks)
        for task in left.values():
            task.cancel()
        await asyncio.gather(*left.values(), return_exceptions=True)
        if self._start_error is None:
            await asyncio.to_thread(self._handle.close)
        return list(left)


def _start(factory: bytes, process_options: dict[str, Any]) -> Any:
    from .._pool._worker import resolve_factory
    from .._serving import Serving

    serving = resolve_factory(pickle.loads(factory))()
    if not isinstance(serving, Serving):
        raise TypeError(f"the pool factory must return a Serving, got {type(serving).__name__}")
    return Serving.start(serving, **process_options)
