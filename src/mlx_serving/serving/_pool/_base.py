"""``PoolClient``: the client contract's verbs of ``ServingPool``, and the helpers that the pool
and both of its backends (processes, Ray actors) share.

The pool provides ``_submit`` / ``_submit_async`` (route a request to a worker and send it,
returning the ``Request`` whose channel receives the worker's messages), ``_consumer()`` (how
those messages become items), ``pool_stats()`` and ``close()``; the verbs, the wait for a ready
worker and the context managers are here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Self

import anyio

from .._client import AsyncStream, Consumer, Stream
from .._errors import DeadlineExceeded, ServingError, WorkerCrashed
from .._request import Request
from .._telemetry import ServingStats
from ._stats import PoolStats

__all__ = ["PoolClient", "check_factory_path", "check_weights", "fail", "refuse", "remote_deadline"]

_MIN_DEADLINE = 0.001  # a worker's serving refuses a deadline <= 0; the caller enforces the real one


class PoolClient:
    """The contract (``Client``) over a backend's ``_submit`` (see the module docstring)."""

    _start_timeout: float
    _worker_name: str  # how errors name one worker ("pool worker", "Ray pool actor")

    def _consumer(self) -> Consumer:
        raise NotImplementedError

    def _submit(self, input: object, stream: bool, deadline: float | None) -> Request:
        raise NotImplementedError

    async def _submit_async(self, input: object, stream: bool, deadline: float | None) -> Request:
        raise NotImplementedError

    def pool_stats(self) -> PoolStats:
        raise NotImplementedError

    def close(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    # ---- the verbs -----------------------------------------------------------------------------
    def run(self, input: object, *, deadline: float | None = None) -> Any:
        """Run one request on the least-loaded worker and return its result (blocks; thread-safe).

        The worker runs ``run_async`` on its serving: client preprocessing, batching with other
        requests routed to it, execution and client postprocessing all happen in the worker.
        Raises what the worker's serving raised, ``WorkerCrashed`` if the worker died holding the
        request, ``ServingStopped`` once closed, ``TypeError`` / ``ValueError`` if the input or
        the result cannot cross to the worker, ``DeadlineExceeded`` when ``deadline`` (seconds
        from this call) passes first: the caller enforces it even if the worker never answers.
        ``ServingError``s carry the request's id. An interrupted caller (e.g.
        ``KeyboardInterrupt``) withdraws the request in the worker.
        """
        consumer = self._consumer()
        with Stream(self._submit(input, False, deadline), consumer) as stream:
            return consumer.result(list(stream))

    async def run_async(self, input: object, *, deadline: float | None = None) -> Any:
        """``run`` for asyncio or trio; cancelling the caller withdraws the request."""
        consumer = self._consumer()
        async with AsyncStream(await self._submit_async(input, False, deadline), consumer) as stream:
            return consumer.result([item async for item in stream])

    def stream(self, input: object, *, deadline: float | None = None) -> Stream:
        """Send the request now; a ``Stream`` of its items (what the worker's ``stream_async``
        yields). Closing it (``close()``, leaving ``with``, an exception while reading) or the
        deadline passing withdraws the request in the worker. Raises as ``run``."""
        return Stream(self._submit(input, True, deadline), self._consumer())

    async def stream_async(self, input: object, *, deadline: float | None = None) -> AsyncStream:
        """``stream`` for asyncio or trio (the request is sent when the await returns); the
        reading task being cancelled, ``aclose()`` or leaving ``async with`` withdraws it."""
        return AsyncStream(await self._submit_async(input, True, deadline), self._consumer())

    def stats(self) -> ServingStats:
        """The workers' serving stats added up (``pool_stats().total``)."""
        return self.pool_stats().total

    # ---- waiting for a ready worker ------------------------------------------------------------
    def _wait_limit(self, request: Request) -> float:
        """Seconds a request may still wait for a ready worker (``start_timeout`` or its deadline)."""
        end = request.submitted + self._start_timeout
        if request.deadline is not None:
            end = min(end, request.deadline)
        return end - time.monotonic()

    def _no_worker(self, request: Request) -> ServingError:
        """The error for a request no worker became ready for (the request is failed with it)."""
        if request.deadline is not None and request.deadline <= request.submitted + self._start_timeout:
            error: ServingError = DeadlineExceeded(
                f"no {self._worker_name} became ready within the request's deadline")
        else:
            error = WorkerCrashed(f"no {self._worker_name} became ready within {self._start_timeout} s")
        return refuse(request, error)

    # ---- lifetime ------------------------------------------------------------------------------
    async def aclose(self, timeout: float | None = None) -> None:
        """``close`` without blocking the event loop."""
        await anyio.to_thread.run_sync(self.close, timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def refuse(request: Request, error: ServingError) -> ServingError:
    """``error`` for a request that was never sent, tagged with its id (``Request.fail``)."""
    request.fail(error)
    return error


def fail(request: Request, error: BaseException) -> None:
    """Fail ``request``; a ``ServingError`` gets its id (not the id the worker's request had)."""
    if isinstance(error, ServingError):
        error.request_id = request.id
    request.fail(error)


def remote_deadline(request: Request) -> float | None:
    """The deadline (seconds from now) to send with a call: what is left of the request's, at
    least 1 ms (the caller enforces the real one anyway); None without one."""
    remaining = request.remaining()
    return None if remaining is None else max(remaining, _MIN_DEADLINE)


def check_weights(weights: Sequence[float] | None, workers: int) -> list[float]:
    """Routing weights, one per worker (default all 1.0); ValueError unless ``workers`` positive
    finite numbers."""
    if weights is None:
        return [1.0] * workers
    weights = [float(w) for w in weights]
    if len(weights) != workers or not all(w > 0 and math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be {workers} positive finite numbers, got {weights}")
    return weights


def check_factory_path(factory: object) -> None:
    """ValueError for a factory import path that is not ``"package.module:function"``."""
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"factory import path must look like 'package.module:function', got {factory!r}")
