"""``ActorWorker``: one incarnation of a ``RayBackend`` slot's actor as the pool sees it.

One actor task per request (``ServingActor.call``, or the streaming generator
``ServingActor.stream``), awaited on the backend's asyncio loop thread (the pump), which puts the
answers on the request's channel. A caller that leaves withdraws the request: the pump stops
waiting and the actor's ``cancel`` cancels the call's task there, so its serving drops the rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from .._errors import RemoteError, RequestCancelled, ServingStopped, WorkerCrashed
from .._pool._backend import PoolEvents, PoolWorker
from .._pool._base import fail, remote_deadline
from .._request import Request
from .._telemetry import ServingStats

__all__ = ["CRASHES", "ActorWorker", "Items", "cause_of"]

CRASHES = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class Items:
    """The ``Consumer`` of a Ray pool request: each channel message is one item (a stream item,
    or a call's result), already deserialized by Ray."""

    live = True

    def on_message(self, message: Any) -> list[Any]:
        return [message]

    def finish(self) -> list[Any]:
        return []

    def result(self, items: list[Any]) -> Any:
        return items[0]


class ActorWorker(PoolWorker):
    """A slot's actor (Ray restarts it in place: each restart is a new ``ActorWorker`` over the
    same actor handle, ``restarted`` True)."""

    def __init__(self, index: int, actor: Any, actor_name: str, restarted: bool, lock: threading.Condition,
                 orphans: deque[Request], loop: asyncio.AbstractEventLoop, events: PoolEvents) -> None:
        super().__init__(index, lock, orphans)
        self.actor, self.actor_name, self.restarted = actor, actor_name, restarted
        self.pumps: dict[int, concurrent.futures.Future[None]] = {}
        self._loop, self._events = loop, events

    def send(self, request: Request, payload: object, stream: bool) -> None:
        """Start the actor task and its pump; raises (a typed error) if the input cannot be
        serialized or the actor is gone."""
        deadline = remote_deadline(request)
        try:
            if stream:
                ref = self.actor.stream.options(num_returns="streaming").remote(request.id, payload, deadline)
            else:
                ref = self.actor.call.remote(request.id, payload, deadline)
        except ray.exceptions.RayError as exc:
            raise self._error(request, exc) from None
        with self.lock:
            if request.id in self.pending:
                self.pumps[request.id] = asyncio.run_coroutine_threadsafe(self._pump(request, ref, stream), self._loop)
                return
        with contextlib.suppress(Exception):  # withdrawn meanwhile
            self.actor.cancel.remote(request.id)

    def withdraw(self, request: Request, error: BaseException) -> None:
        """Stop waiting for the call and cancel it in the actor (nothing is sent for a call that
        already finished)."""
        with self.lock:
            held = self.pending.pop(request.id, None) is not None
            pump = self.pumps.pop(request.id, None)
        if pump is not None:
            pump.cancel()
        if held:
            with contextlib.suppress(Exception):  # the actor is gone: nothing left to cancel
                self.actor.cancel.remote(request.id)

    def ask_stats(self) -> Callable[[float], ServingStats | None]:
        ref = self.actor.stats.remote()

        def answer(timeout: float) -> ServingStats | None:
            try:
                return ray.get(ref, timeout=max(timeout, 0.01))
            except Exception:
                return None

        return answer

    def is_alive(self) -> bool:
        """True: Ray detects a dead actor (its calls fail; the pool then marks it stopped)."""
        return True

    def name(self) -> str:
        return f"Ray pool actor {self.index} ({self.actor_name}, pid {self.pid})"

    def pending_pumps(self) -> list[concurrent.futures.Future[None]]:
        """The pumps still waiting for an answer."""
        with self.lock:
            return list(self.pumps.values())

    # --- answers ------------------------------------------------------------------------------

    async def _pump(self, request: Request, ref: Any, stream: bool) -> None:
        """Put the actor's answers for ``request`` on its channel; runs on the pump loop."""
        try:
            if stream:
                async for item_ref in ref:
                    item = await item_ref
                    request.channel.put(item)
                    self._heard()
            else:
                request.channel.put(await ref)
            with self.lock:
                held = self.pending.pop(request.id, None) is not None
                self.pumps.pop(request.id, None)
            self._heard()
            if held:
                request.channel.close()
        except asyncio.CancelledError:
            pass  # the caller withdrew the request
        except Exception as exc:
            with self.lock:
                self.pending.pop(request.id, None)
                self.pumps.pop(request.id, None)
            self._heard()
            if isinstance(exc, CRASHES):
                self._lost(exc)
            fail(request, self._error(request, exc))

    def _heard(self) -> None:
        self.last_progress = self.last_heartbeat = time.time()

    def _lost(self, exc: Exception) -> None:
        """The actor died: fail its other calls; the pool routes around it until it is back."""
        detached = self._events.detach(self, "stopped", "restarting", expect=("ready", "closing"))
        if detached is None:  # another call of it reported it already
            return
        pending = detached[1]
        self._events.retire(self, 0 if self._events.closing else self.calls(pending))
        for request in pending.values():
            fail(request, self._error(request, exc))

    def _error(self, request: Request, exc: Exception) -> Exception:
        """The caller-side error for a failed actor task."""
        if isinstance(exc, CRASHES):
            if self._events.closing:
                return ServingStopped(f"{self.name()} stopped before request {request.id} finished")
            return WorkerCrashed(f"{self.name()} died while running request {request.id}: {exc}")
        if isinstance(exc, ray.exceptions.TaskCancelledError):
            return RequestCancelled(f"request {request.id} was cancelled")
        if isinstance(exc, ray.exceptions.RayTaskError):
            return cause_of(exc, f"{self.name()} raised: {exc}")
        if isinstance(exc, ray.exceptions.RayError):
            return WorkerCrashed(f"{self.name()} failed request {request.id}: {exc!r}")
        return exc


def cause_of(exc: ray.exceptions.RayTaskError, message: str) -> Exception:
    """The exception an actor method raised (its own type), or a ``RemoteError`` (``message``)
    carrying its type name, message and traceback when it is not an ``Exception``."""
    cause = exc.cause
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return cause
    error = RemoteError(message)
    error.type_name = type(cause).__qualname__ if cause is not None else ""
    error.message = str(cause) if cause is not None else str(exc)
    error.remote_traceback = getattr(exc, "traceback_str", "")
    return error
