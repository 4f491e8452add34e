"""Iterative scheduler: continuous batching for ``IterativeBackend`` objects.

Rows wait in one FIFO. A partition with no active rows waits for the first arrival, then keeps
an admission window open for ``batch_timeout`` seconds (or until enough rows wait to fill it) so
that arrivals in the window are admitted together. While rows are active the partition loops:
cancel withdrawn rows, admit up to ``min(batch_size - active, free_slots)`` waiting rows, expire
rows past their deadline, run one step, deliver each row's events to its caller.

A backend with its own scheduler (an optional ``waiting(state)``: it queues the rows it cannot
start yet and orders them by its own policy, as the text-generation engine does) is handed the
queue instead: each iteration a partition takes every waiting row (with several partitions its
share, ``ceil(queued / partitions)``, or what it can start now if more), so there is one queue,
the backend's (``ServingStats.queued`` / ``running`` then split by its ``waiting`` count, which
can lag a row's hand-off or cancellation by one step). That holds while the backend can start no more rows than ``batch_size`` leaves
(the text-generation default, ``batch_size`` = ``max_batch``); a smaller ``batch_size`` falls back
to admitting ``min(batch_size - active, free_slots)`` rows at a time. Its waiting rows still count as queued for ``max_queue`` and the stats, and the
serving keeps deadlines and cancellation for them.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ._backend import IterativeBackend, QueueingBackend, is_queueing
from ._batch import Batch
from ._channel import Waker, wake
from ._counters import Counters, too_big
from ._errors import BackendError, ServingOverloaded, ServingStopped
from ._options import ProcessOptions
from ._messages import RowEvent
from ._request import Request, reap
from ._telemetry import ServingStats, TelemetryEvent, emit

_log = logging.getLogger("mlx_serving.serving")
S = TypeVar("S")  # an iterative backend's state


class _Row:
    __slots__ = ("request", "index", "payload", "id", "partition", "done")

    def __init__(self, request: Request, index: int, payload: Any, row_id: int):
        self.request, self.index, self.payload, self.id = request, index, payload, row_id
        self.partition: _Partition | None = None
        self.done = False


class _Partition:
    __slots__ = ("index", "state", "active", "to_cancel")

    def __init__(self, index: int, state: Any):
        self.index, self.state = index, state
        self.active: dict[int, _Row] = {}
        self.to_cancel: list[int] = []


class IterativeScheduler:
    """Continuous-batching scheduler (see module docstring); one step loop per partition."""

    def __init__(self, backend: IterativeBackend, states: list[Any], options: ProcessOptions, batch_size: int,
                 telemetry: Callable[[TelemetryEvent], None] | None):
        self._backend, self._opts, self._batch_size = backend, options, batch_size
        self._telemetry = telemetry
        self._parts = [_Partition(i, s) for i, s in enumerate(states)]
        self._cond = threading.Condition(threading.RLock())
        self.orphans: deque[Request] = deque()
        self._waiting: deque[_Row] = deque()  # may hold withdrawn rows (done=True), skipped on take
        self._deadlines: list[tuple[float, int, Request]] = []
        self._ids = itertools.count()
        self._stopping = False
        self._aborting = False
        self._c = Counters()
        # the backend when it orders its own queue (it has ``waiting``), else None
        self._queueing: QueueingBackend | None = backend if is_queueing(backend) else None

    def bind_state(self, index: int, state: object) -> None:
        """Set partition ``index``'s backend state (inline runs initialize it lazily)."""
        self._parts[index].state = state

    # ---- caller side -------------------------------------------------------------------------
    def submit(self, request: Request, batch: Batch) -> None:
        """Queue the batch's rows; raises ServingStopped / ServingOverloaded."""
        payloads = batch.rows()
        reap(self.orphans)
        with self._cond:
            if self._stopping:
                raise ServingStopped("the serving is stopped")
            max_queue = self._opts.max_queue
            too_big(len(payloads), max_queue, self._c)
            queued = self._c.queued + self._backend_waiting()
            if max_queue is not None and queued + len(payloads) > max_queue:
                self._c.rejected += 1
                raise ServingOverloaded(f"{queued} rows queued; max_queue is {max_queue}")
            request.owner = self
            request.rows = [_Row(request, i, p, next(self._ids)) for i, p in enumerate(payloads)]
            self._waiting.extend(request.rows)
            self._c.queued += len(payloads)
            if request.deadline is not None:
                self._purge_deadlines()
                heapq.heappush(self._deadlines, (request.deadline, request.rows[0].id, request))
            self._cond.notify_all()

    def _purge_deadlines(self) -> None:
        """Drop finished requests from the deadline heap once they are most of it (lock held):
        its size stays within twice the rows in flight (plus 64), whatever the deadlines."""
        heap = self._deadlines
        if len(heap) > 64 and len(heap) > 2 * (self._c.queued + self._c.running):
            self._deadlines = [entry for entry in heap if not entry[2].done]
            heapq.heapify(self._deadlines)

    def withdraw(self, request: Request, error: BaseException) -> None:
        with self._cond:
            self._c.count_end(error)
            self._drop(request.rows)

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        """End these rows of ``request`` now; the request completes when no row is left."""
        with self._cond:
            rows = [request.rows[i] for i in indices if not request.rows[i].done]
            self._drop(rows)
            request.rows_left -= len(rows)
            if request.rows_left == 0 and request.channel.close():
                self._c.completed += 1

    def _drop(self, rows: list[_Row]) -> None:
        for row in rows:
            if row.done:
                continue
            row.done = True
            if row.partition is None:
                self._c.queued -= 1
            else:
                del row.partition.active[row.id]
                row.partition.to_cancel.append(row.id)
                self._c.running -= 1
        self._cond.notify_all()

    def stats(self) -> ServingStats:
        with self._cond:
            snapshot = self._c.snapshot()
            waiting = self._backend_waiting()
        return replace(snapshot, queued=snapshot.queued + waiting, running=snapshot.running - waiting,
                       backend=add_backend_stats(self._backend, [p.state for p in self._parts]))

    def _backend_waiting(self) -> int:
        """Rows a queueing backend holds and has not started, over every partition (0 for others).
        Its ``waiting(state)`` reads a plain counter: safe from any thread."""
        queueing = self._queueing
        if queueing is None:
            return 0
        return sum(queueing.waiting(p.state) for p in self._parts if p.state is not None)

    def add_counts_to(self, total: Counters) -> None:
        """Add this scheduler's counters into ``total`` (the inline runtime's sum)."""
        with self._cond:
            total.add(self._c)

    def stop(self) -> None:
        """Refuse new requests, fail waiting ones with ServingStopped; active rows run on."""
        with self._cond:
            self._stopping = True
            waiting = {id(r.request): r.request for r in self._waiting if not r.done}
            self._cond.notify_all()
        for request in waiting.values():
            request.fail(ServingStopped("the serving stopped before this request ran"))

    def abort(self) -> None:
        """After the shutdown timeout: fail active rows with ServingStopped; loops exit."""
        with self._cond:
            self._aborting = True
            active = {id(r.request): r.request for p in self._parts for r in p.active.values()}
            self._cond.notify_all()
        for request in active.values():
            request.fail(ServingStopped("the serving stopped while this request was running"))

    # ---- executor side -----------------------------------------------------------------------
    def run_partition(self, index: int, drain: bool = False) -> None:
        """Step loop of one partition. ``drain``: return once idle (inline runs) instead of waiting."""
        part = self._parts[index]
        while not self._aborting:
            try:
                if not self._iteration(part, drain):
                    return
            except BaseException as exc:  # a backend call raised (even a BaseException): fail, never stop the loop
                self._recover(part, exc)

    def release(self, index: int) -> None:
        """After partition ``index``'s step loop ended, on its executor thread: :func:`close_state`."""
        close_state(self._backend, self._parts[index].state)

    def _iteration(self, part: _Partition, drain: bool) -> bool:
        """Cancel, admit, expire, step once. False when the loop should end."""
        backend = self._backend
        reap(self.orphans)
        self._apply_cancels(part)
        active = backend.active(part.state)
        free = backend.free_slots(part.state)
        room = min(self._batch_size - active, free)
        hand_off = self._queueing is not None and free <= self._batch_size - self._running(part)  # within batch_size
        rows = self._take(part, active, max(room, 1) if active == 0 else room, drain, free if hand_off else None)
        if rows is None:
            return False
        start = time.perf_counter()
        if rows:
            self._admit(part, rows)
        self._expire(time.monotonic())
        self._apply_cancels(part)
        if backend.active(part.state) > 0:
            self._step(part)
        emit(self._telemetry, TelemetryEvent("step", time.perf_counter() - start, self._running(part), part.index))
        return True

    def _recover(self, part: _Partition, cause: BaseException) -> None:
        """Fail the partition's active rows (or, if none, the next waiting request) with ``cause``."""
        with self._cond:
            requests = [r.request for r in part.active.values()]
            if not requests:
                requests = [r.request for r in self._waiting if not r.done][:1]
        for request in {id(r): r for r in requests}.values():
            request.fail(_backend_error(cause))
        try:
            self._apply_cancels(part)
        except BaseException:
            _log.exception("IterativeBackend.cancel failed while recovering from %r", cause)

    def _apply_cancels(self, part: _Partition) -> None:
        with self._cond:
            ids, part.to_cancel = part.to_cancel, []
        if ids:
            self._backend.cancel(part.state, ids)

    def _take(self, part: _Partition, active: int, room: int, drain: bool, free: int | None) -> list[_Row] | None:
        """Waiting rows to admit now ([] to just step); None when the loop should end. ``room``:
        the window's target and the count taken, unless ``free`` is given (a queueing backend that
        starts at most ``free`` rows now, within ``batch_size``): then its share of the queue, at
        least ``free``."""
        with self._cond:
            if active == 0 and not part.to_cancel:
                if not self._wait_window(part, room, drain):
                    return None
            if free is not None:
                room = max(free, -(-self._c.queued // len(self._parts)))
            rows: list[_Row] = []
            while self._waiting and len(rows) < room:
                row = self._waiting.popleft()
                if row.done:
                    continue
                row.partition = part
                part.active[row.id] = row
                rows.append(row)
            self._c.queued -= len(rows)
            self._c.running += len(rows)
            return rows

    def _wait_window(self, part: _Partition, room: int, drain: bool) -> bool:
        """Idle: wait for a first arrival, then the batch_timeout window. False: end the loop."""
        while True:
            while self._c.queued == 0:
                if part.to_cancel:
                    return True
                if self._stopping or self._aborting or drain:
                    return False
                self._cond.wait()
            first = next(r for r in self._waiting if not r.done)
            window_end = first.request.submitted + self._opts.batch_timeout
            while self._c.queued and self._c.queued < room and not self._aborting:
                left = window_end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._aborting:
                return False
            if self._c.queued:
                return True

    def _admit(self, part: _Partition, rows: list[_Row]) -> None:
        """Admit ``rows``. If the backend raises for a group, undo it (``cancel``) and admit the
        rows one by one, so the error fails only the row that caused it."""
        try:
            rejected = self._backend.admit(part.state, [(r.id, r.payload) for r in rows], part.index)
        except BaseException as exc:
            if len(rows) == 1:
                self._fail_rows(part, rows, exc)
                return
            self._backend.cancel(part.state, [r.id for r in rows])
            for row in rows:
                if not row.done:
                    self._admit(part, [row])
            return
        self._reject(part, rejected)

    def _reject(self, part: _Partition, rejected: list[tuple[int, BaseException]]) -> None:
        """Rows the backend can never fit: each fails its own request with the backend's error."""
        for row_id, error in rejected:
            with self._cond:
                row = part.active.pop(row_id, None)
                if row is None or row.done:
                    continue
                row.done = True
                self._c.running -= 1
                if row.request.channel.close(error):
                    self._c.rejected += 1
                    self._drop(row.request.rows)

    def _expire(self, now: float) -> None:
        expired = []
        with self._cond:
            while self._deadlines and self._deadlines[0][0] <= now:
                expired.append(heapq.heappop(self._deadlines)[2])
        for request in expired:
            request.expire()

    def _step(self, part: _Partition) -> None:
        try:
            events = self._backend.step(part.state)
        except BaseException as exc:
            self._fail_rows(part, list(part.active.values()), exc)
            return
        wakers: list[Waker] = []  # the readers' wake-ups: one per event loop, after the step's events
        try:
            with self._cond:
                self._deliver(part, events, wakers)
        finally:
            wake(wakers)

    def _deliver(self, part: _Partition, events: list[tuple[int, Any, bool]], wakers: list[Waker]) -> None:
        """Put each event on its row's channel; end done rows (lock held)."""
        self._c.steps_run += 1
        self._c.fill_sum += self._running(part) / self._batch_size
        active = part.active
        for row_id, event, done in events:
            row = active.get(row_id)
            if row is None:
                continue
            request = row.request
            request.channel.put(RowEvent(row.index, event), wakers)
            if done:
                row.done = True
                del active[row_id]
                self._c.running -= 1
                request.rows_left -= 1
                if request.rows_left == 0 and request.channel.close(deferred=wakers):
                    self._c.completed += 1

    def _running(self, part: _Partition) -> int:
        """Rows of the partition the backend has started (a queueing backend's waiting ones left out)."""
        queueing = self._queueing
        return len(part.active) - (queueing.waiting(part.state) if queueing is not None else 0)

    def _fail_rows(self, part: _Partition, rows: list[_Row], cause: BaseException) -> None:
        """A backend call raised: fail the requests of these rows, cancel what it still holds."""
        for request in {id(r.request): r.request for r in rows}.values():
            request.fail(_backend_error(cause))
        self._apply_cancels(part)


def close_state(backend: IterativeBackend[S], state: S) -> None:
    """The backend's optional ``close(state)``: release a partition's state (device memory) on the
    calling thread, the partition's own, rather than on whichever thread drops it last. A raising
    ``close`` is logged, never raised."""
    close = getattr(backend, "close", None)
    if close is None:
        return
    try:
        close(state)
    except Exception:
        _log.exception("IterativeBackend.close failed")


def add_backend_stats(backend: IterativeBackend, states: list[Any]) -> dict[str, float]:
    """The backend's ``stats(state)`` summed over ``states`` ({} when it has none)."""
    stats = getattr(backend, "stats", None)
    total: dict[str, float] = {}
    if not callable(stats):
        return total
    for state in states:
        if state is not None:
            for name, value in stats(state).items():
                total[name] = total.get(name, 0) + value
    return total


def _backend_error(cause: BaseException) -> BackendError:
    error = BackendError(f"the backend failed on a step holding this request: {cause!r}")
    error.__cause__ = cause
    return error
