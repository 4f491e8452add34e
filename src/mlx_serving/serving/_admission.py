"""Admission for the iterative scheduler: who holds the waiting rows, chosen once per scheduler.

:func:`admission_for` picks one of two strategies for a backend:

- :class:`PlainAdmission` (an ``IterativeBackend``): the serving's FIFO holds the waiting rows and a
  partition takes ``min(batch_size - active, free_slots)`` of them between steps (at least one when
  it is idle, so a row that never fits is rejected rather than left waiting). Its hand-off hooks are
  no-ops: every taken row runs.
- :class:`QueueingAdmission` (a ``QueueingBackend``, with ``waiting(state)``): the backend holds the
  queue and orders it by its own policy. A partition whose backend runs at most ``batch_size`` rows
  at once (``free_slots`` when idle) takes every waiting row (with several partitions its share,
  ``ceil(queued / partitions)``, or what it can start now if more); one that could run more is held
  to ``batch_size`` rows, started or not, as a plain backend is, so ``batch_size`` always bounds
  the rows running. Rows handed over and not started count as queued (``max_queue``, stats).

Every method runs with the scheduler's lock held, but ``running``, which a partition's own thread
also reads without it.
"""

from __future__ import annotations

from typing import Any, Protocol

from ._backend import IterativeBackend, QueueingBackend, is_queueing
from ._request import Request

__all__ = ["Admission", "PlainAdmission", "QueueingAdmission", "Partition", "Row", "admission_for", "plain_quota"]


class Row:
    """One row of a request. ``partition``: the partition it was handed to (None while queued in
    the serving); ``done``: finished or withdrawn; ``stepped``: the backend has sent it an event."""

    __slots__ = ("request", "index", "payload", "id", "partition", "done", "stepped")

    def __init__(self, request: Request, index: int, payload: Any, row_id: int):
        self.request, self.index, self.payload, self.id = request, index, payload, row_id
        self.partition: Partition | None = None
        self.done = False
        self.stepped = False


class Partition:
    """One step loop's record: its backend ``state``, the rows handed to it and not finished
    (``active``, by row id) and the withdrawn ones its backend still holds (``to_cancel``)."""

    __slots__ = ("index", "state", "active", "to_cancel")

    def __init__(self, index: int, state: Any):
        self.index, self.state = index, state
        self.active: dict[int, Row] = {}
        self.to_cancel: list[int] = []


def plain_quota(batch_size: int, active: int, free: int) -> int:
    """Rows a partition takes from the serving's FIFO: ``min(batch_size - active, free)``, at least
    one when it is idle (``active`` == 0); also the admission window's target."""
    room = min(batch_size - active, free)
    return max(room, 1) if active == 0 else room


class Admission(Protocol):
    """How a partition takes waiting rows and how its handed rows split into queued / running."""

    def quota(self, part: Partition, active: int, free: int, queued: int) -> int:
        """Rows ``part`` takes now: its backend's ``active`` / ``free_slots`` read this iteration,
        ``queued`` rows waiting in the serving."""
        ...

    def taken(self, part: Partition, rows: int) -> None:
        """``rows`` rows were handed to ``part`` (its backend admits them next)."""
        ...

    def withdrawn(self, part: Partition, row: Row) -> None:
        """``row``, handed to ``part``, left before finishing (cancelled, expired, rejected, failed)."""
        ...

    def sync(self, part: Partition) -> None:
        """On ``part``'s thread, after its backend admitted, cancelled or stepped."""
        ...

    def waiting(self) -> int:
        """Handed rows the backends hold and have not started, over every partition."""
        ...

    def running(self, part: Partition) -> int:
        """Handed rows ``part``'s backend has started."""
        ...


class PlainAdmission:
    """The serving's FIFO, ``plain_quota`` rows at a time; every handed row runs."""

    def __init__(self, batch_size: int):
        self._batch_size = batch_size

    def quota(self, part: Partition, active: int, free: int, queued: int) -> int:
        return plain_quota(self._batch_size, active, free)

    def taken(self, part: Partition, rows: int) -> None:
        pass

    def withdrawn(self, part: Partition, row: Row) -> None:
        pass

    def sync(self, part: Partition) -> None:
        pass

    def waiting(self) -> int:
        return 0

    def running(self, part: Partition) -> int:
        return len(part.active)


class QueueingAdmission:
    """The backend's queue (see module docstring). Per partition it keeps the count of handed rows
    its backend has not started: read from ``waiting(state)`` on the partition's thread once its
    backend holds exactly its active rows (no cancel pending), raised by each hand-off and lowered
    by each withdrawal of a row that has had no event yet, so the stats read no backend from
    another thread and ``queued + running`` is always ``rows_in_flight``. A withdrawn row that is
    running without an event yet (a chunked prefill) or was preempted back is miscounted until the
    partition cancels it, before its next step."""

    def __init__(self, backend: QueueingBackend[Any], batch_size: int, parts: list[Partition]):
        self._backend, self._batch_size, self._parts = backend, batch_size, parts
        self._waiting = [0] * len(parts)
        self._hands_all = [False] * len(parts)  # the backend runs at most batch_size rows (seen idle)

    def quota(self, part: Partition, active: int, free: int, queued: int) -> int:
        if active == 0:  # idle: free_slots is the most rows the backend runs at once
            self._hands_all[part.index] = free <= self._batch_size
        if self._hands_all[part.index]:
            return max(free, -(-queued // len(self._parts)))
        return plain_quota(self._batch_size, active, free)

    def taken(self, part: Partition, rows: int) -> None:
        self._waiting[part.index] += rows

    def withdrawn(self, part: Partition, row: Row) -> None:
        if not row.stepped:
            self._waiting[part.index] = max(0, self._waiting[part.index] - 1)

    def sync(self, part: Partition) -> None:
        if not part.to_cancel:
            self._waiting[part.index] = self._backend.waiting(part.state)

    def waiting(self) -> int:
        return sum(min(w, len(p.active)) for w, p in zip(self._waiting, self._parts))

    def running(self, part: Partition) -> int:
        return len(part.active) - min(self._waiting[part.index], len(part.active))


def admission_for(backend: IterativeBackend[Any], batch_size: int, parts: list[Partition]) -> Admission:
    """:class:`QueueingAdmission` for a backend with ``waiting(state)``, else :class:`PlainAdmission`
    (``parts``: the scheduler's partitions, all of them)."""
    if is_queueing(backend):
        return QueueingAdmission(backend, batch_size, parts)
    return PlainAdmission(batch_size)
