"""``Drain``: what open requests do when the server shuts down (SIGTERM, Ctrl-C).

uvicorn stops accepting connections and waits for open ones; :class:`DrainingServer` (what
``mlx-serving serve`` runs) calls :meth:`Drain.set` at the signal, and sse-starlette does for each
open stream (``Drain`` is each ``EventSourceResponse``'s ``shutdown_event``). From then on every
request has ``grace`` seconds to finish as usual; a stream still open at the end gets an error event
(OpenAI's shape, code ``shutting_down``) and ``[DONE]``, a whole (non-streamed) response a 503 JSON
error with that code, and its request is withdrawn. Both wait under :meth:`Drain.scope`, whose
deadline the shutdown moves in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import anyio
import uvicorn

__all__ = ["Drain", "DrainingServer"]


class Drain:
    """The shutdown deadline of a server's open streams: ``grace`` seconds (>= 0) after :meth:`set`.
    Raises ValueError for a negative or non-finite ``grace``."""

    def __init__(self, grace: float) -> None:
        if not (math.isfinite(grace) and grace >= 0):
            raise ValueError(f"shutdown_grace must be a finite number of seconds >= 0, got {grace!r}")
        self.grace = grace
        self.deadline = math.inf  #: anyio's clock (``anyio.current_time()``) when streams are cut
        self._scopes: set[anyio.CancelScope] = set()

    @property
    def draining(self) -> bool:
        """The server is shutting down."""
        return self.deadline != math.inf

    def set(self) -> None:
        """Shutdown began (called by sse-starlette, once per open stream; the first call counts)."""
        if self.draining:
            return
        self.deadline = anyio.current_time() + self.grace
        for scope in self._scopes:
            scope.deadline = self.deadline

    def is_set(self) -> bool:
        """As ``anyio.Event.is_set`` (sse-starlette's ``shutdown_event`` interface)."""
        return self.draining

    @contextmanager
    def scope(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope cancelled at the shutdown deadline (never, until shutdown begins); check
        its ``cancelled_caught`` after the block. Do not ``yield`` inside it from an async generator."""
        scope = anyio.CancelScope(deadline=self.deadline)
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that starts ``drain``'s grace period at the shutdown signal, so whole
    (non-streamed) responses get it too (sse-starlette only tells open streams); uvicorn's own
    ``timeout_graceful_shutdown`` should exceed ``drain.grace``."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drained: concurrent.futures.Future[None] | None = None

    async def serve(self, sockets: Any = None) -> None:  # Any: uvicorn's own annotation
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is not None and not self._drain.draining:  # a signal handler: hand it to the loop
            self._drained = asyncio.run_coroutine_threadsafe(self._begin(), self._loop)  # in a task: anyio's clock
        super().handle_exit(sig, frame)

    async def _begin(self) -> None:
        self._drain.set()
