"""What a `ServingPool` reports about itself: per-worker health and stats, and their sum."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .._telemetry import ServingStats

__all__ = ["NO_STATS", "PoolStats", "WorkerHealth", "WorkerStats", "retire", "sum_stats"]


@dataclass(frozen=True)
class WorkerHealth:
    """One worker slot. state: "starting" | "ready" | "restarting" | "unresponsive" | "closing" |
    "stopped" ("unresponsive": it missed heartbeats for the pool's liveness_timeout, and is being
    killed and replaced; "restarting": it died and is being replaced).

    alive: the process runs and accepts calls. last_progress: Unix time (s) of the last answer,
    stream item or error the worker sent (its start time before any). last_heartbeat: Unix time
    of the last message of any kind it sent, heartbeats included. in_flight: requests routed to it
    and not finished. restarts: times the slot's worker was replaced after dying or hanging."""

    index: int
    pid: int | None
    state: str
    alive: bool
    in_flight: int
    last_progress: float
    last_heartbeat: float
    restarts: int


@dataclass(frozen=True)
class WorkerStats:
    """One worker's serving stats (None when it was not ready or did not answer in 5 s)."""

    index: int
    pid: int | None
    in_flight: int
    restarts: int
    serving: ServingStats | None


@dataclass(frozen=True)
class PoolStats:
    """Pool snapshot (``ServingPool.pool_stats()``): ``total`` sums the workers' counts (what
    ``ServingPool.stats()`` returns); ``workers`` has one entry per slot."""

    total: ServingStats
    workers: tuple[WorkerStats, ...]


def sum_stats(stats: list[ServingStats]) -> ServingStats:
    """Counts added up; ``mean_batch_fill`` weighted by each one's batches + steps."""
    totals: dict = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(ServingStats) if f.name != "backend"}
    backend: dict[str, float] = {}
    for s in stats:
        for name, value in s.backend.items():
            backend[name] = backend.get(name, 0) + value
    totals["backend"] = backend
    work = [s.batches_run + s.steps_run for s in stats]
    totals["mean_batch_fill"] = (
        sum(s.mean_batch_fill * w for s, w in zip(stats, work)) / sum(work) if sum(work) else 0.0
    )
    return ServingStats(**totals)


#: Zero counts: the pool's retired totals before any worker was lost.
NO_STATS = ServingStats(queued=0, running=0, rows_in_flight=0, batches_run=0, steps_run=0, mean_batch_fill=0.0,
                        completed=0, failed=0, cancelled=0, expired=0, rejected=0)


def retire(retired: ServingStats, last: ServingStats | None, crashed: int) -> ServingStats:
    """``retired`` plus a lost worker's counts, so that the pool's totals never go down when a
    worker dies: its last reported stats (``last``; None if it never answered a stats query) and
    ``crashed`` requests it took with it, counted ``failed``. Levels (``queued``, ``running``,
    ``rows_in_flight``) are 0, and the backend's own numbers (a mix of levels and counters) are the
    live workers' only. What the worker finished after its last stats query is not counted."""
    total = sum_stats([retired, last]) if last is not None else retired
    return replace(total, queued=0, running=0, rows_in_flight=0, failed=total.failed + crashed, backend={})
