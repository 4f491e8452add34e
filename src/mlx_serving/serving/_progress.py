"""Stuck detection for health checks: the HTTP server's ``/health`` and the Ray deployment's ``check_health``.

A serving is stuck when it holds rows (``rows_in_flight`` > 0) and has made no progress (no batch,
step or ended request: ``batches_run``, ``steps_run``, ``completed``, ``failed``, ``cancelled``,
``expired``, ``rejected`` unchanged) for more than ``stuck_after`` seconds, across health checks.
"""

from __future__ import annotations

import time

from ._telemetry import ServingStats

__all__ = ["Progress"]


class Progress:
    """Tracks one serving's progress between health checks."""

    def __init__(self, stuck_after: float) -> None:
        self.stuck_after = stuck_after
        self._last: tuple[int, ...] | None = None
        self._since = time.monotonic()

    def stuck_for(self, stats: ServingStats) -> float | None:
        """Seconds (monotonic clock) without progress while holding rows, when that exceeds
        ``stuck_after``; else None. Call it at each health check with the serving's latest stats."""
        progress = (stats.batches_run, stats.steps_run, stats.completed, stats.failed, stats.cancelled,
                    stats.expired, stats.rejected)
        now = time.monotonic()
        if progress != self._last or stats.rows_in_flight == 0:
            self._last, self._since = progress, now
            return None
        idle = now - self._since
        return idle if idle > self.stuck_after else None
