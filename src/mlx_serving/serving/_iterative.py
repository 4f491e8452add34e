"""Iterative scheduler: continuous batching for ``IterativeBackend`` objects.

Rows wait in one FIFO. A partition with no active rows waits for the first arrival, then keeps
an admission window open for ``batch_timeout`` seconds (or until enough rows wait to fill it) so
that arrivals in the window are admitted together. While rows are active the partition loops:
cancel withdrawn rows, admit waiting rows, expire rows past their deadline, run one step, deliver
each row's events to its caller.

How many waiting rows a partition takes, and how the rows handed to the backend split into queued
and running, is the admission strategy's (``_admission``, chosen once here): the serving's FIFO,
``min(batch_size - active, free_slots)`` rows at a time, for a plain backend; the backend's own
queue for one with ``waiting(state)`` (the text-generation engine), whose handed rows still count
as queued for ``max_queue`` and the stats, and whose deadlines and cancellation the serving keeps.
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

from ._admission import Partition, Row, admission_for, plain_quota
from ._backend import IterativeBackend
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


class IterativeScheduler:
    """Continuous-batching scheduler (see module docstring); one step loop per partition."""

    def __init__(self, backend: IterativeBackend, states: list[Any], options: ProcessOptions, batch_size: int,
                 telemetry: Callable[[TelemetryEvent], None] | None):
        self._backend, self._opts, self._batch_size = backend, options, batch_size
        self._telemetry = telemetry
        self._parts = [Partition(i, s) for i, s in enumerate(states)]
        self._admission = admission_for(backend, batch_size, self._parts)
        self._cond = threading.Condition(threading.RLock())
        self.orphans: deque[Request] = deque()
        self._waiting: deque[Row] = deque()  # may hold withdrawn rows (done=True), skipped on take
        self._deadlines: list[tuple[float, int, Request]] = []
        self._ids = itertools.count()
        self._stopping = False
        self._aborting = False
        self._c = Counters()

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
            queued = self._c.queued + self._admission.waiting()
            if max_queue is not None and queued + len(payloads) > max_queue:
                self._c.rejected += 1
                raise ServingOverloaded(f"{queued} rows queued; max_queue is {max_queue}")
            request.owner = self
            request.rows = [Row(request, i, p, next(self._ids)) for i, p in enumerate(payloads)]
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

    def _drop(self, rows: list[Row]) -> None:
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
                self._admission.withdrawn(row.partition, row)
        self._cond.notify_all()

    def stats(self) -> ServingStats:
        with self._cond:
            snapshot = self._c.snapshot()
            waiting = self._admission.waiting()
        return replace(snapshot, queued=snapshot.queued + waiting, running=snapshot.running - waiting,
                       backend=add_backend_stats(self._backend, [p.state for p in self._parts]))

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

    def _iteration(self, part: Partition, drain: bool) -> bool:
        """Cancel, admit, expire, step once. False when the loop should end."""
        backend = self._backend
        reap(self.orphans)
        self._apply_cancels(part)
        rows = self._take(part, backend.active(part.state), backend.free_slots(part.state), drain)
        if rows is None:
            return False
        start = time.perf_counter()
        if rows:
            self._admit(part, rows)
            with self._cond:
                self._admission.sync(part)
        self._expire(time.monotonic())
        self._apply_cancels(part)
        if backend.active(part.state) > 0:
            self._step(part)
        rows_run = self._admission.running(part)
        emit(self._telemetry, TelemetryEvent("step", time.perf_counter() - start, rows_run, part.index))
        return True

    def _recover(self, part: Partition, cause: BaseException) -> None:
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

    def _apply_cancels(self, part: Partition) -> None:
        with self._cond:
            ids, part.to_cancel = part.to_cancel, []
        if ids:
            self._backend.cancel(part.state, ids)
            with self._cond:
                self._admission.sync(part)

    def _take(self, part: Partition, active: int, free: int, drain: bool) -> list[Row] | None:
        """Waiting rows to hand to ``part`` now, as many as the admission strategy's quota ([] to
        just step); None when the loop should end. ``active`` / ``free``: its backend's counts."""
        with self._cond:
            if active == 0 and not part.to_cancel:
                if not self._wait_window(part, plain_quota(self._batch_size, 0, free), drain):
                    return None
            quota = self._admission.quota(part, active, free, self._c.queued)
            rows: list[Row] = []
            while self._waiting and len(rows) < quota:
                row = self._waiting.popleft()
                if row.done:
                    continue
                row.partition = part
                part.active[row.id] = row
                rows.append(row)
            self._c.queued -= len(rows)
            self._c.running += len(rows)
            self._admission.taken(part, len(rows))
            return rows

    def _wait_window(self, part: Partition, room: int, drain: bool) -> bool:
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

    def _admit(self, part: Partition, rows: list[Row]) -> None:
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

    def _reject(self, part: Partition, rejected: list[tuple[int, BaseException]]) -> None:
        """Rows the backend can never fit: each fails its own request with the backend's error."""
        for row_id, error in rejected:
            with self._cond:
                row = part.active.pop(row_id, None)
                if row is None or row.done:
                    continue
                row.done = True
                self._c.running -= 1
                self._admission.withdrawn(part, row)
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

    def _step(self, part: Partition) -> None:
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

    def _deliver(self, part: Partition, events: list[tuple[int, Any, bool]], wakers: list[Waker]) -> None:
        """Put each event on its row's channel; end done rows (lock held)."""
        self._c.steps_run += 1
        self._admission.sync(part)
        self._c.fill_sum += self._admission.running(part) / self._batch_size
        active = part.active
        for row_id, event, done in events:
            row = active.get(row_id)
            if row is None:
                continue
            row.stepped = True
            request = row.request
            request.channel.put(RowEvent(row.index, event), wakers)
            if done:
                row.done = True
                del active[row_id]
                self._c.running -= 1
                request.rows_left -= 1
                if request.rows_left == 0 and request.channel.close(deferred=wakers):
                    self._c.completed += 1

    def _fail_rows(self, part: Partition, rows: list[Row], cause: BaseException) -> None:
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
