"""``Client``: the one contract every way of calling a serving implements.

Implementations: a ``Serving`` itself (inline: ``Serving.run``), a ``ServingHandle``
(``Serving.start``), a ``ServingPool`` (worker processes). A front end (HTTP server, Ray
replica, CLI) holds a ``Client`` and never branches on which one (httpx's transport base class
under its sync and async clients is the model).

Semantics, identical everywhere:

- ``run`` / ``run_async``: one request, its postprocessed result.
- ``stream`` / ``stream_async``: the request is submitted when the stream is made (for
  ``stream_async``, when the await returns); items arrive as produced.
- Cancellation: ``Stream.close()``, ``AsyncStream.aclose()``, leaving a ``with`` block, the
  caller's task being cancelled, or ``deadline`` (seconds from the call) passing withdraws the
  request: queued rows are removed at once, running rows leave before the next step.
- Errors: subclasses of ``ServingError`` carrying ``request_id``; bad input raises what the
  serving's client preprocessing raised (``ValueError`` ...), in the caller only.
- ``stats()``: a ``ServingStats`` snapshot (a pool sums its workers'). ``close()`` /
  ``aclose()``: refuse new requests, let running ones finish (bounded), free threads and
  processes; idempotent; every client is also a (async) context manager.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

from ._client import AsyncStream, Stream
from ._telemetry import ServingStats

__all__ = ["Client"]

In_contra = TypeVar("In_contra", contravariant=True)
Out_co = TypeVar("Out_co", covariant=True)


@runtime_checkable
class Client(Protocol[In_contra, Out_co]):
    """See the module docstring. ``Client[In, Out]``: ``run(input: In) -> Out``; stream items are
    the serving's (transducer items, or ``(output, metadata)`` per static chunk)."""

    def run(self, input: In_contra, *, deadline: float | None = None) -> Out_co: ...

    async def run_async(self, input: In_contra, *, deadline: float | None = None) -> Out_co: ...

    def stream(self, input: In_contra, *, deadline: float | None = None) -> Stream[Any]: ...

    async def stream_async(self, input: In_contra, *, deadline: float | None = None) -> AsyncStream[Any]: ...

    def stats(self) -> ServingStats: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...
