"""``Drain``: what open streams do when the server shuts down (SIGTERM, Ctrl-C).

uvicorn stops accepting connections and waits for open ones; sse-starlette notices the shutdown and
calls :meth:`Drain.set` (passed to each ``EventSourceResponse`` as its ``shutdown_event``). From then
on every stream has ``grace`` seconds to finish as usual; one still open at the end gets an error
event (OpenAI's shape, code ``shutting_down``) and ``[DONE]``, and its request is withdrawn. A
stream waits for its next item under :meth:`Drain.scope`, whose deadline the shutdown moves in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

__all__ = ["Drain"]


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
