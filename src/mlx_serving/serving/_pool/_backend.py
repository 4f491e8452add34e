"""The seam between ``ServingPool`` and its backend (``ProcessBackend``, ``RayBackend``).

The pool owns what every backend shares: the slots, routing weights, the submit loop, restarts,
health, stats and the order of ``close``. A backend object owns how a worker starts
(``start`` / ``await_ready``), how a call reaches it and its answers come back (its
``PoolWorker`` subclass), liveness, and teardown (``stop`` / ``kill`` / ``close``). The backend
tells the pool about lost workers through ``PoolEvents``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .._client import Consumer
from .._request import Request
from .._telemetry import ServingStats
from ._worker import Factory

__all__ = ["PoolBackend", "PoolEvents", "PoolWorker", "WorkerGone"]


class WorkerGone(Exception):
    """Raised by ``PoolBackend.await_ready`` for a restarting worker that will not come back
    (the pool marks its slot ``dead`` and stops restarting it)."""


class PoolWorker:
    """One incarnation of a slot's worker as the pool sees it, and the ``Owner`` (see
    ``serving._request``) of the requests routed to it. A backend subclasses it with ``send``,
    ``withdraw``, ``ask_stats``, ``is_alive``, ``begin`` and ``name``.

    ``state``: starting | ready | closing | unresponsive | stopped (set by the pool, under
    ``lock``, the pool's condition, which also guards ``pending``).
    """

    def __init__(self, index: int, lock: threading.Condition, orphans: deque[Request]) -> None:
        self.index = index
        self.pid: int | None = None
        self.state = "starting"
        self.pending: dict[int, Request] = {}  # by request id, which is also the call's id there
        self.queries: set[int] = set()  # ids in ``pending`` that are stats queries, not calls
        self.orphans = orphans  # the pool's: requests whose stream was dropped unclosed
        self.last_progress = time.time()  # Unix time of its last answer
        self.last_heartbeat = time.time()  # Unix time of its last sign of life
        self.last_stats: ServingStats | None = None  # its latest answer to a stats query
        self.lock = lock

    def send(self, request: Request, payload: object, stream: bool) -> None:
        """Send the call ``request`` (registered in ``pending``); raises what makes it unsendable
        (the request is failed with it)."""
        raise NotImplementedError

    def withdraw(self, request: Request, error: BaseException) -> None:
        """The caller left or its deadline passed: forget the call and stop it in the worker."""
        raise NotImplementedError

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        """Raises TypeError: a pool call's transducer runs in the worker, which stops its rows."""
        raise TypeError("a pool request cannot stop rows from the caller; the worker's serving does")

    def ask_stats(self) -> Callable[[float], ServingStats | None]:
        """Ask for the serving's stats now; a function waiting up to its argument (seconds) for the
        answer (None if none came)."""
        raise NotImplementedError

    def is_alive(self) -> bool:
        """Whether the worker is up (for ``health()``)."""
        raise NotImplementedError

    def begin(self) -> None:
        """The pool routes to this worker from now on (e.g. start reading its messages)."""

    def name(self) -> str:
        """How errors name this worker."""
        raise NotImplementedError

    def calls(self, pending: dict[int, Request]) -> int:
        """How many of ``pending`` (taken from this worker) are calls, not stats queries."""
        return sum(1 for request_id in pending if request_id not in self.queries)


class PoolEvents(Protocol):
    """What a backend tells its pool (``ServingPool`` implements it)."""

    @property
    def closing(self) -> bool:
        """Whether ``close()`` has begun."""
        ...

    def detach(self, worker: PoolWorker, state: str, cause: str,
               expect: tuple[str, ...] | None = None) -> tuple[str, dict[int, Request]] | None:
        """The worker is lost: set its ``state``, take its pending calls and start its slot's
        replacement (health shows ``cause`` meanwhile) unless closing or already replaced.
        Returns (its previous state, its calls); None (nothing done) when ``expect`` is given
        and its state is not in it."""
        ...

    def retire(self, worker: PoolWorker, crashed: int) -> None:
        """Keep a lost worker's counts in the pool's totals, ``crashed`` calls failed."""
        ...

    def watched(self, states: tuple[str, ...]) -> list[PoolWorker]:
        """The slots' current workers whose state is in ``states``."""
        ...


class PoolBackend(Protocol):
    """How a ``ServingPool`` runs its workers (``ProcessBackend``, ``RayBackend``). One backend
    object serves one pool."""

    worker_name: str  # how errors name one worker ("pool worker")

    def bind(self, factory: Factory, workers: int, process_options: dict[str, Any], events: PoolEvents) -> None:
        """Check ``factory`` and the backend's options for ``workers`` workers (ValueError /
        TypeError), then take what the workers share (a Ray connection, a monitor thread);
        RuntimeError if already bound to a pool."""
        ...

    def consumer(self) -> Consumer[Any]:
        """How a request's channel messages become items."""
        ...

    def encode(self, input: object) -> object:
        """``input`` as ``PoolWorker.send`` takes it; TypeError if it cannot be sent."""
        ...

    def start(self, index: int, lock: threading.Condition, orphans: deque[Request]) -> PoolWorker:
        """Start slot ``index``'s worker (no wait for it to be ready)."""
        ...

    def await_ready(self, worker: PoolWorker, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic seconds) for the worker to be ready and set its
        pid; raise its start error, TimeoutError, WorkerCrashed, or WorkerGone."""
        ...

    def kill(self, worker: PoolWorker) -> None:
        """Kill a worker that holds no calls (failed start, replaced, or the pool is closing)."""
        ...

    def stop(self, workers: list[PoolWorker], live: list[PoolWorker], timeout: float) -> None:
        """Ask the ``live`` workers to finish their calls within ``timeout`` s and stop; then
        (by ``timeout`` + 5 s at most) see every one of ``workers`` gone."""
        ...

    def close(self) -> None:
        """Release what ``bind`` took (threads, connections). Idempotent."""
        ...
