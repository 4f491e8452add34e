"""Static scheduler: Nx.Serving-style batch collection for ``Backend`` objects.

Each batch key has an open stack. The first row landing in an empty stack sets its deadline
(``batch_timeout`` later); a stack that reaches ``batch_size`` rows closes and joins the FIFO of
ready batches. Idle partition threads take the earliest of (oldest ready batch, oldest expired
stack); an expired stack stays open, still accepting rows, until a partition takes it. A request
larger than the room left is split across stacks and reassembled in order by its caller.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ._backend import Backend
from ._batch import Batch
from ._counters import Counters, too_big
from ._errors import BackendError, ServingOverloaded, ServingStopped
from ._options import ProcessOptions
from ._output import check_output_rows
from ._messages import Part
from ._request import Request, reap
from ._telemetry import ServingStats, TelemetryEvent, emit


class _Entry:
    __slots__ = ("request", "offset", "batch")

    def __init__(self, request: Request, offset: int, batch: Batch):
        self.request, self.offset, self.batch = request, offset, batch


class _Stack:
    __slots__ = ("key", "entries", "rows", "ready_at")

    def __init__(self, key: Any, ready_at: float):
        self.key, self.rows, self.ready_at = key, 0, ready_at
        self.entries: list[_Entry] = []


class StaticScheduler:
    """Collects rows into batches and runs them on partition threads (see module docstring)."""

    def __init__(self, backend: Backend, state: object, options: ProcessOptions, batch_size: int,
                 telemetry: Callable[[TelemetryEvent], None] | None):
        self._backend, self._state, self._opts = backend, state, options
        self._batch_size, self._telemetry = batch_size, telemetry
        self._cond = threading.Condition(threading.RLock())
        self._open: dict[Any, _Stack] = {}
        self._ready: deque[_Stack] = deque()
        self._stopping = False
        self._running: dict[int, list[_Entry]] = {}  # batches on partition threads, by id
        self._c = Counters()
        self.orphans: deque[Request] = deque()

    # ---- caller side -------------------------------------------------------------------------
    def submit(self, request: Request, batch: Batch) -> None:
        """Enqueue ``batch`` for ``request``; raises ServingStopped / ServingOverloaded."""
        reap(self.orphans)
        with self._cond:
            if self._stopping:
                raise ServingStopped("the serving is stopped")
            max_queue = self._opts.max_queue
            too_big(batch.size, max_queue, self._c)
            if max_queue is not None and self._c.queued + batch.size > max_queue:
                self._c.rejected += 1
                raise ServingOverloaded(f"{self._c.queued} rows queued; max_queue is {max_queue}")
            request.owner = self
            self._c.queued += batch.size
            self._push(request, batch)
            self._cond.notify_all()

    def _push(self, request: Request, batch: Batch) -> None:
        offset, now = 0, time.monotonic()
        rest: Batch | None = batch
        while rest is not None:
            stack = self._open.get(batch.batch_key)
            if stack is not None and not stack.entries[0].batch.compatible(rest):
                self._close(stack, now)  # other row shapes: dispatch it, start a new one
                stack = None
            if stack is None:
                stack = self._open[batch.batch_key] = _Stack(batch.batch_key, now + self._opts.batch_timeout)
            room = self._batch_size - stack.rows
            piece, rest = (rest, None) if rest.size <= room else rest.split(room)
            stack.entries.append(_Entry(request, offset, piece))
            stack.rows += piece.size
            offset += piece.size
            if stack.rows >= self._batch_size:
                self._close(stack, now)

    def _close(self, stack: _Stack, now: float) -> None:
        del self._open[stack.key]
        stack.ready_at = now
        self._ready.append(stack)

    def withdraw(self, request: Request, error: BaseException) -> None:
        """Remove the request's queued rows (running ones finish; their output is dropped)."""
        with self._cond:
            self._c.count_end(error)
            for stack in [*self._open.values(), *self._ready]:
                kept = [e for e in stack.entries if e.request is not request]
                if len(kept) != len(stack.entries):
                    removed = stack.rows - sum(e.batch.size for e in kept)
                    stack.entries, stack.rows = kept, stack.rows - removed
                    self._c.queued -= removed
                    if not kept:
                        self._discard(stack)

    def _discard(self, stack: _Stack) -> None:
        if self._open.get(stack.key) is stack:
            del self._open[stack.key]
        else:
            self._ready.remove(stack)

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        raise TypeError("stop_rows needs an iterative backend")

    def stats(self) -> ServingStats:
        with self._cond:
            return self._c.snapshot()

    def stop(self) -> None:
        """Refuse new requests and fail queued ones with ServingStopped; running batches finish."""
        with self._cond:
            self._stopping = True
            requests = {id(e.request): e.request for s in [*self._open.values(), *self._ready] for e in s.entries}
            self._open.clear()
            self._ready.clear()
            self._c.queued = 0
            self._cond.notify_all()
        for request in requests.values():
            request.fail(ServingStopped("the serving stopped before this request ran"))

    def abort(self) -> None:
        """After the shutdown timeout: fail callers of still-running batches with ServingStopped."""
        with self._cond:
            requests = [e.request for entries in self._running.values() for e in entries]
        for request in requests:
            request.fail(ServingStopped("the serving stopped while this request was running"))

    # ---- executor side -----------------------------------------------------------------------
    def run_partition(self, partition: int) -> None:
        """The partition's loop: take the next batch, run it; return once stopped and drained."""
        while True:
            reap(self.orphans)  # outside the lock: cancelling takes it
            entries = self._next(partition)
            if entries is None:
                return
            self._execute(entries, partition)

    def _next(self, partition: int) -> list[_Entry] | None:
        with self._cond:
            while True:
                now = time.monotonic()
                stack = self._pick(now)
                if stack is not None:
                    entries = self._claim(stack, now)
                    if entries:
                        return entries
                    continue
                if self._stopping:
                    return None
                deadlines = [s.ready_at for s in self._open.values()]
                self._cond.wait(min(deadlines) - now if deadlines else None)

    def _pick(self, now: float) -> _Stack | None:
        expired = min(self._open.values(), key=lambda s: s.ready_at, default=None)
        if expired is not None and expired.ready_at > now:
            expired = None
        if self._ready and (expired is None or self._ready[0].ready_at <= expired.ready_at):
            return self._ready.popleft()
        if expired is not None:
            del self._open[expired.key]
        return expired

    def _claim(self, stack: _Stack, now: float) -> list[_Entry]:
        self._c.queued -= stack.rows
        live = []
        for entry in stack.entries:
            if entry.request.expired(now):
                entry.request.expire()
            elif not entry.request.done:
                live.append(entry)
        self._c.running += sum(e.batch.size for e in live)
        if live:
            self._running[id(live)] = live
        return live

    def _execute(self, entries: list[_Entry], partition: int) -> None:
        rows = sum(e.batch.size for e in entries)
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            batch = entries[0].batch if len(entries) == 1 else Batch.merge([e.batch for e in entries])
            output, metadata = self._backend.handle_batch(batch, partition, self._state)
            check_output_rows(output, rows, self._batch_size)
        except BaseException as exc:
            error = exc
        duration = time.perf_counter() - start
        with self._cond:
            del self._running[id(entries)]
            self._c.running -= rows
            self._c.batches_run += 1
            self._c.fill_sum += rows / self._batch_size
            if error is None:
                self._deliver(entries, output, metadata)
        if error is not None:
            for entry in entries:
                entry.request.fail(_backend_error(error))
        emit(self._telemetry, TelemetryEvent("execute", duration, rows, partition, entries[0].batch.batch_key, error))

    def _deliver(self, entries: list[_Entry], output: Any, metadata: Any) -> None:
        start = 0
        for entry in entries:
            request, size = entry.request, entry.batch.size
            request.channel.put(Part(entry.offset, output, metadata, start, size))
            start += size
            request.delivered += size
            if request.delivered == request.size and request.channel.close():
                self._c.completed += 1


def _backend_error(cause: BaseException) -> BackendError:
    error = BackendError(f"the backend failed on a batch holding this request: {cause!r}")
    error.__cause__ = cause
    return error
