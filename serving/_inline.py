"""Inline runtime of a ``Serving``: its own executor thread and a state initialized once, lazily.

``Serving.run`` does not batch across callers: each call's rows run alone (split by
``batch_size``), in call order, on the serving's executor thread, so model work always happens on
the one thread that owns it (MLX streams are thread-local).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._backend import is_iterative
from ._batch import Batch
from ._errors import BackendError
from ._executor import Executor
from ._iterative import IterativeScheduler
from ._options import ProcessOptions
from ._output import output_rows
from ._request import Request
from ._telemetry import TelemetryEvent, timed

_UNSET: Any = object()


class InlineRuntime:
    """Lazily started executor thread plus the backend state it initialized (``mode="inline"``)."""

    def __init__(self, backend: Any, arg: Any, batch_size: int | None,
                 telemetry: Callable[[TelemetryEvent], None] | None):
        self._backend, self._arg, self._batch_size, self._telemetry = backend, arg, batch_size, telemetry
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._state = _UNSET  # touched only on the executor thread

    def close(self) -> None:
        """End the executor thread after queued runs (called when the Serving is collected)."""
        with self._lock:
            if self._executor is not None:
                self._executor.close()

    def submit(self, request: Request, batch: Batch) -> None:
        """Queue one call's rows; the result or events arrive on ``request.channel``."""
        if is_iterative(self._backend):
            size = self._batch_size or batch.size
            scheduler = IterativeScheduler(self._backend, [None], ProcessOptions(batch_timeout=0.0), size,
                                           self._telemetry)
            scheduler.submit(request, batch)
            job: Callable[[], None] = lambda: self._run_iterative(request, scheduler)
        else:
            request.owner = self
            job = lambda: self._run_static(request, batch)
        with self._lock:
            if self._executor is None:
                self._executor = Executor("serving-inline")
            self._executor.submit(job)

    def withdraw(self, request: Request, error: BaseException) -> None:
        """Nothing to remove: a queued run sees the request is done and skips it."""

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        raise TypeError("stop_rows needs an iterative backend")

    def _get_state(self) -> Any:
        if self._state is _UNSET:
            self._state = self._backend.init("inline", self._arg, 1)
        return self._state

    def _run_iterative(self, request: Request, scheduler: IterativeScheduler) -> None:
        if request.done:
            return
        try:
            scheduler.bind_state(0, self._get_state())
        except Exception as exc:
            request.fail(_backend_error(exc))
            return
        scheduler.run_partition(0, drain=True)

    def _run_static(self, request: Request, batch: Batch) -> None:
        offset, rest = 0, batch
        try:
            state = self._get_state()
            while rest is not None and not request.done:
                limit = self._batch_size or rest.size
                chunk, rest = (rest, None) if rest.size <= limit else rest.split(limit)
                with timed(self._telemetry, "execute", chunk.size, partition=0, batch_key=chunk.batch_key):
                    output, metadata = self._backend.handle_batch(chunk, 0, state)
                if output_rows(output) < chunk.size:
                    raise ValueError(f"handle_batch returned {output_rows(output)} rows for a batch of {chunk.size}")
                request.channel.put(("part", offset, output, metadata, 0, chunk.size))
                offset += chunk.size
        except Exception as exc:
            request.fail(_backend_error(exc))
            return
        request.channel.close()


def _backend_error(cause: BaseException) -> BackendError:
    error = BackendError(f"the backend failed on this request: {cause!r}")
    error.__cause__ = cause
    return error
