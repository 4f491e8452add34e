"""Telemetry: timed events sent to a callback, and the stats snapshot of a running serving."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ServingStats", "TelemetryEvent"]

_log = logging.getLogger("mlx_serving.serving")

EventKind = Literal["preprocessing", "execute", "step", "postprocessing"]


@dataclass(frozen=True)
class TelemetryEvent:
    """One timed phase.

    kind: ``preprocessing`` / ``postprocessing`` (in the caller's thread, one per request),
    ``execute`` (one static batch on an executor thread) or ``step`` (one admission + step of an
    iterative backend). duration_s: wall time in seconds (``time.perf_counter``). rows: rows in
    the batch or step (postprocessing: the request's rows; preprocessing: 0, not yet known). partition: executor partition,
    None in the caller. error: the exception raised by the phase, if any.
    """

    kind: EventKind
    duration_s: float
    rows: int
    partition: int | None = None
    batch_key: Any = None
    error: BaseException | None = None


Callback = Callable[[TelemetryEvent], None]


def emit(callback: Callback | None, event: TelemetryEvent) -> None:
    """Send ``event``; a failing callback is logged and never reaches the serving or caller."""
    if callback is None:
        return
    try:
        callback(event)
    except Exception:
        _log.exception("telemetry callback failed")


@contextmanager
def timed(callback: Callback | None, kind: EventKind, rows: int, *, partition: int | None = None,
          batch_key: Hashable = None) -> Iterator[None]:
    """Time the block and emit one event (with the error, re-raised, if the block raised)."""
    if callback is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        emit(callback, TelemetryEvent(kind, time.perf_counter() - start, rows, partition, batch_key, exc))
        raise
    emit(callback, TelemetryEvent(kind, time.perf_counter() - start, rows, partition, batch_key))


@dataclass(frozen=True)
class ServingStats:
    """A snapshot of a running serving (counts of rows or requests, as named).

    queued: rows waiting to run (the queue depth that ``max_queue`` bounds). running: rows in an
    executing batch or admitted into an iterative backend. rows_in_flight: queued + running.
    batches_run: static batches executed. steps_run: iterative steps. mean_batch_fill: mean of
    rows / batch_size over executed batches (static) or steps (iterative), 0.0 before any.
    completed / failed / cancelled / expired / rejected: requests that finished normally, failed
    with a backend error or stop, were withdrawn by their caller, passed their deadline, or were
    refused (``ServingOverloaded`` or rows the backend can never fit). backend: the backend's own
    counters (an ``IterativeBackend``'s optional ``stats(state)``) summed over partitions and
    workers; text generation reports its KV blocks and prefix cache there (``blocks_used``,
    ``blocks_free``, ``prefix_queries``, ``prefix_hits``, ``prefix_hit_tokens``, ...).
    """

    queued: int
    running: int
    rows_in_flight: int
    batches_run: int
    steps_run: int
    mean_batch_fill: float
    completed: int
    failed: int
    cancelled: int
    expired: int
    rejected: int
    backend: Mapping[str, float] = field(default_factory=dict)
