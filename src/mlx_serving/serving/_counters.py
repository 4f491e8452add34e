"""Counters shared by the schedulers (mutated under the scheduler's lock)."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import DeadlineExceeded, RequestCancelled, RequestTooLarge
from ._telemetry import ServingStats


@dataclass
class Counters:
    """The scheduler's request and row counts (``snapshot`` is :class:`ServingStats`)."""

    queued: int = 0
    running: int = 0
    batches_run: int = 0
    steps_run: int = 0
    fill_sum: float = 0.0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    rejected: int = 0

    def count_end(self, error: BaseException) -> None:
        """Count a request that ended with ``error``."""
        if isinstance(error, RequestCancelled):
            self.cancelled += 1
        elif isinstance(error, DeadlineExceeded):
            self.expired += 1
        else:
            self.failed += 1

    def add(self, other: Counters) -> None:
        """Add ``other``'s counts into these."""
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> ServingStats:
        runs = self.batches_run + self.steps_run
        return ServingStats(
            queued=self.queued,
            running=self.running,
            rows_in_flight=self.queued + self.running,
            batches_run=self.batches_run,
            steps_run=self.steps_run,
            mean_batch_fill=self.fill_sum / runs if runs else 0.0,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            expired=self.expired,
            rejected=self.rejected,
        )


def too_big(rows: int, max_queue: int | None, counters: Counters) -> None:
    """RequestTooLarge (a ValueError, counted as rejected) for a request of more ``rows`` than
    ``max_queue``: it could never be queued, so it is bad input, not an overload to retry
    (``ServingOverloaded``)."""
    if max_queue is not None and rows > max_queue:
        counters.rejected += 1
        raise RequestTooLarge(f"the request has {rows} rows, more than the serving queues at once (max_queue "
                              f"{max_queue}): split it", rows=rows, max_queue=max_queue)
