"""What a decode step costs as a function of its rows: the speculator's cost model.

A verify row of k draft tokens is k + 1 one-token rows of the step (the native CPU path runs them
as decode rows; elsewhere they are a k + 1-token span), and a step that verifies lands before the
next one is planned (no pipelining). :class:`StepCosts` keeps, per (rows, verifying), the moving
average of the measured wall time of such steps (:meth:`StepCosts.observe`, fed by the engine
through :class:`StepTimer`) and estimates the cost of a step not measured yet
(:meth:`StepCosts.estimate`) from its measured neighbours.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["BETA", "ROW_PRIOR", "StepCosts", "StepTimer"]

#: Weight of the newest measurement in a step cost's moving average.
BETA = 0.2

#: The cost of a row beyond the largest measured step, as a fraction of that step's cost per row,
#: while the measurements cannot tell (fewer than two of them): optimistic on purpose, so that a
#: row whose drafts hold tries a verify once and the measurement settles it.
ROW_PRIOR = 0.25

_Key = tuple[bool, int]


@dataclass
class StepCosts:
    """Seconds per decode step, by whether it verifies and its one-token rows ``n`` (plain decode
    rows plus k + 1 per verify row): moving averages (weight :data:`BETA`) of measured steps in
    ``table``. ``frozen``: measurements are ignored (tests give the costs)."""

    table: dict[_Key, float] = field(default_factory=dict)
    frozen: bool = False

    def observe(self, rows: int, verifying: bool, seconds: float) -> None:
        """A measured step of ``rows`` one-token rows (>= 1) took ``seconds`` (> 0; a figure
        above 4x the average counts as 4x: one stall of a shared machine moves it little)."""
        if self.frozen or rows < 1 or seconds <= 0:
            return
        old = self.table.get((verifying, rows))
        self.table[(verifying, rows)] = seconds if old is None else old + BETA * (min(seconds, 4 * old) - old)

    def estimate(self, rows: int, verifying: bool) -> float | None:
        """Seconds for a step of ``rows`` one-token rows; None before any step was measured.

        Measured: its average. Else from the measured steps of the same kind (a verifying one
        with none: the plain ones, a lower bound): linear between the nearest measured below and
        above; below all of them proportional to the smallest (``t * rows / n``); above all of
        them the largest plus, per extra row, the slope from the smallest to the largest, at
        least :data:`ROW_PRIOR` of the largest's cost per row."""
        return self.curve(verifying)(rows)

    def curve(self, verifying: bool) -> Callable[[int], float | None]:
        """:meth:`estimate` of steps of one kind as a function of their rows, over the table as it
        is now (sorted once: a step's choice asks for many row counts)."""
        own = self._points(verifying)
        points, exact = own or self._points(False), dict(own)
        return lambda rows: exact[rows] if rows in exact else _between(points, rows)

    def _points(self, verifying: bool) -> list[tuple[int, float]]:
        return sorted((n, t) for (v, n), t in self.table.items() if v == verifying)


def _between(points: list[tuple[int, float]], rows: int) -> float | None:
    """The estimate at ``rows`` from measured ``points`` (sorted ``(rows, seconds)``; none: None)."""
    if not points:
        return None
    i = bisect.bisect_left(points, (rows,))  # points[:i] below rows, points[j:] above
    j = i + (i < len(points) and points[i][0] == rows)
    if 0 < i and j < len(points):
        (n0, t0), (n1, t1) = points[i - 1], points[j]
        return t0 + (t1 - t0) * (rows - n0) / (n1 - n0)
    if j < len(points):
        n1, t1 = points[j]
        return t1 * rows / n1
    (n0, t0), (n1, t1) = points[0], points[-1]
    slope = ROW_PRIOR * t1 / n1 if n1 == n0 else max(ROW_PRIOR * t1 / n1, (t1 - t0) / (n1 - n0))
    return t1 + slope * (rows - n1)


class StepTimer:
    """Measures the engine's decode steps into ``costs()`` (the speculator's current
    :class:`StepCosts`): a step's time is from the landing of the
    step before it (or the start of the :meth:`~..engine.Engine.step` call that enqueued it, if
    later: the engine was idle) to its own landing, host work included: what a step costs the
    caller, pipelined or not. Steps with prefill chunks are not measured."""

    def __init__(self, costs: Callable[[], StepCosts]):
        self.costs = costs
        self._landed = 0.0
        self._started = 0.0

    def start(self) -> None:
        """An :meth:`~..engine.Engine.step` call begins."""
        self._started = time.perf_counter()

    def enqueued(self, rows: int, verifying: bool, prefilling: bool) -> tuple[int, bool, float] | None:
        """A step was enqueued (``rows`` one-token rows, whether it ``verifying`` and whether it
        has prefill chunks): the key to give :meth:`landed` (None: not measured)."""
        return None if prefilling or rows < 1 else (rows, verifying, self._started)

    def landed(self, key: tuple[int, bool, float] | None) -> None:
        """The step of ``key`` (from :meth:`enqueued`) landed now."""
        now = time.perf_counter()
        if key is not None:
            rows, verifying, started = key
            self.costs().observe(rows, verifying, now - max(self._landed, started))
        self._landed = now
