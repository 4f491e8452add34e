"""Inline mode of a ``Serving``: its own executor thread and a state initialized once, lazily.

``Serving.run`` does not batch across callers: each call's rows run alone (split by
``batch_size``), in call order, on the serving's executor thread, so model work always happens on
the one thread that owns it (MLX streams are thread-local).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ._backend import Backend, IterativeBackend, is_iterative
from ._batch import Batch
from ._client import LocalClient, Runtime, ServingSpec
from ._counters import Counters
from ._errors import BackendError, ServingStopped
from ._executor import Executor
from ._iterative import IterativeScheduler, add_backend_stats, close_state
from ._messages import Part
from ._options import ProcessOptions
from ._output import check_output_rows
from ._request import Request, reap
from ._telemetry import ServingStats, TelemetryEvent, timed

_UNSET: Any = object()

In = TypeVar("In")
Out = TypeVar("Out")


class InlineRuntime:
    """Lazily started executor thread plus the backend state it initialized (``mode="inline"``)."""

    def __init__(self, backend: Backend | IterativeBackend, arg: object, batch_size: int | None,
                 telemetry: Callable[[TelemetryEvent], None] | None):
        self._backend, self._arg, self._batch_size, self._telemetry = backend, arg, batch_size, telemetry
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.RLock())  # guards the counters
        self._c = Counters()  # static runs, plus the counts of iterative runs that ended
        self._live: set[IterativeScheduler] = set()  # iterative runs not ended (one scheduler each)
        self.orphans: deque[Request] = deque()
        self._executor: Executor | None = None
        self._closed = False
        self._state = _UNSET  # touched only on the executor thread

    def close(self) -> None:
        """Refuse new runs; the executor thread ends after the queued ones, and after an iterative
        backend's optional ``close(state)`` on it once a run built the state. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._executor is not None:
                backend = self._backend
                if is_iterative(backend):
                    self._executor.submit(lambda: self._release(backend))
                self._executor.close()

    def _release(self, backend: IterativeBackend) -> None:
        if self._state is not _UNSET:
            close_state(backend, self._state)

    def stats(self) -> ServingStats:
        total = Counters()
        with self._cond:
            total.add(self._c)
            live = list(self._live)
        for scheduler in live:
            scheduler.add_counts_to(total)
        state = None if self._state is _UNSET else self._state
        backend = add_backend_stats(self._backend, [state]) if is_iterative(self._backend) else {}
        return replace(total.snapshot(), backend=backend)

    def submit(self, request: Request, batch: Batch) -> None:
        """Queue one call's rows; the result or events arrive on ``request.channel``."""
        reap(self.orphans)
        if is_iterative(self._backend):
            size = self._batch_size or batch.size
            scheduler = IterativeScheduler(self._backend, [None], ProcessOptions(batch_timeout=0.0), size,
                                           self._telemetry)
            job: Callable[[], None] = lambda: self._run_iterative(request, scheduler)
            with self._lock:
                executor = self._open_executor()
                scheduler.submit(request, batch)
                with self._cond:
                    self._live.add(scheduler)
                executor.submit(job)
            return
        backend = self._backend  # a static Backend: not is_iterative
        with self._lock:
            executor = self._open_executor()
            request.owner = self
            with self._cond:
                self._c.queued += batch.size
            executor.submit(lambda: self._run_static(request, batch, backend))

    def _open_executor(self) -> Executor:
        if self._closed:
            raise ServingStopped("the serving was closed")
        if self._executor is None:
            self._executor = Executor("serving-inline")
        return self._executor

    def withdraw(self, request: Request, error: BaseException) -> None:
        """Count the end; a queued run sees the request is done and skips it."""
        with self._cond:
            self._c.count_end(error)

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        raise TypeError("stop_rows needs an iterative backend")

    def _get_state(self) -> Any:
        if self._state is _UNSET:
            self._state = self._backend.init("inline", self._arg, 1)
        return self._state

    def _run_iterative(self, request: Request, scheduler: IterativeScheduler) -> None:
        try:
            if request.done:
                return
            try:
                scheduler.bind_state(0, self._get_state())
            except BaseException as exc:
                request.fail(_backend_error(exc))
                return
            scheduler.run_partition(0, drain=True)
        finally:
            with self._cond:  # its counts join the runtime's; a later withdraw changes none
                self._live.discard(scheduler)
                scheduler.add_counts_to(self._c)

    def _run_static(self, request: Request, batch: Batch, backend: Backend) -> None:
        with self._cond:
            self._c.queued -= batch.size
            self._c.running += batch.size
        try:
            self._run_chunks(request, batch, backend)
        except BaseException as exc:
            request.fail(_backend_error(exc))
        else:
            if request.channel.close():
                with self._cond:
                    self._c.completed += 1
        finally:
            with self._cond:
                self._c.running -= batch.size

    def _run_chunks(self, request: Request, batch: Batch, backend: Backend) -> None:
        offset = 0
        rest: Batch | None = batch
        state = self._get_state()
        while rest is not None and not request.done:
            limit = self._batch_size or rest.size
            chunk, rest = (rest, None) if rest.size <= limit else rest.split(limit)
            with timed(self._telemetry, "execute", chunk.size, partition=0, batch_key=chunk.batch_key):
                output, metadata = backend.handle_batch(chunk, 0, state)
            check_output_rows(output, chunk.size, limit)
            with self._cond:
                self._c.batches_run += 1
                self._c.fill_sum += chunk.size / limit
            request.channel.put(Part(offset, output, metadata, 0, chunk.size))
            offset += chunk.size


class InlineClient(LocalClient[In, Out]):
    """The client contract over a serving's inline runtime (what ``Serving.run`` uses)."""

    def __init__(self, serving: ServingSpec[In, Out], runtime: InlineRuntime):
        self._serving, self._inline = serving, runtime

    def _runtime(self) -> Runtime:
        return self._inline

    def stats(self) -> ServingStats:
        """Counters of the inline runs so far (``queued`` / ``running``: rows of calls now)."""
        return self._inline.stats()

    def close(self) -> None:
        """End the executor thread after queued runs; later calls raise ``ServingStopped``."""
        self._inline.close()


def _backend_error(cause: BaseException) -> BackendError:
    error = BackendError(f"the backend failed on this request: {cause!r}")
    error.__cause__ = cause
    return error
