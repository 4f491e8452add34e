"""A backend that raises anything, BaseException subclasses included, never stops a serving:
the callers of that batch or step get BackendError (the original as __cause__), later requests
are served, and the counters return to zero."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from mlx_serving.serving import BackendError, Batch, Serving
from serving_fakes import CountdownBackend, countdown
from portable import peak_rss_kib


class ForeignCancel(BaseException):
    """What a foreign library's cancellation looks like (trio.Cancelled is a BaseException)."""


RAISED = [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError, ForeignCancel, RuntimeError]


class Bomb:
    """Raises ``kind`` when the marked value comes through; ``where`` picks the call."""

    def __init__(self, kind: type[BaseException]):
        self.kind = kind

    def check(self, values: Any) -> None:
        if 13 in list(np.asarray(values).ravel()):
            raise self.kind("bomb")


class StaticBomb(Bomb):
    def init(self, mode: str, arg: Any, partitions: int) -> None:
        return None

    def handle_batch(self, batch: Batch, partition: int, state: Any) -> tuple[Any, Any]:
        self.check(batch.data[: batch.size])
        return batch.data * 2, None


class IterativeBomb(CountdownBackend):
    """Countdown rows; a row of 13 makes ``where`` ("admit" or "step") raise ``kind``."""

    def __init__(self, kind: type[BaseException], where: str):
        super().__init__()
        self.kind, self.where = kind, where
        self.attempts: list[int] = []  # rows per admit call

    def admit(self, state: dict, rows: list, partition: int) -> list:
        self.attempts.append(len(rows))
        if self.where == "admit" and any(n == 13 for _, n in rows):
            state["rows"].update({row_id: int(n) for row_id, n in rows if n != 13})  # partly admitted
            raise self.kind("bomb in admit")
        return super().admit(state, rows, partition)

    def step(self, state: dict) -> list:
        if self.where == "step" and 13 in state["rows"].values():
            raise self.kind("bomb in step")
        return super().step(state)


def _static_rows(*values: float) -> Batch:
    return Batch.concatenate([np.array(values, dtype=np.float64)])


@pytest.mark.parametrize("kind", RAISED, ids=lambda k: k.__name__)
@pytest.mark.parametrize("mode", ["inline", "process"])
def test_static_backend(kind, mode):
    serving = Serving.new(StaticBomb(kind))
    with (serving if mode == "inline" else serving.start(batch_size=4, batch_timeout=0.0)) as client:
        with pytest.raises(BackendError) as info:
            client.run(_static_rows(1, 13))
        assert isinstance(info.value.__cause__, kind)
        assert client.run(_static_rows(1, 2)).tolist() == [2, 4]
        stats = client.stats()
        assert (stats.queued, stats.running, stats.failed, stats.completed) == (0, 0, 1, 1)


@pytest.mark.parametrize("kind", RAISED, ids=lambda k: k.__name__)
@pytest.mark.parametrize("where", ["admit", "step"])
@pytest.mark.parametrize("mode", ["inline", "process"])
def test_iterative_backend(kind, where, mode):
    serving = Serving.new(IterativeBomb(kind, where))
    with (serving if mode == "inline" else serving.start(batch_size=8, batch_timeout=0.0)) as client:
        with pytest.raises(BackendError) as info:
            client.run(countdown(13))
        assert isinstance(info.value.__cause__, kind)
        assert [e for _, e in client.run(countdown(2))] == [1, 0]
        stats = client.stats()
        assert (stats.queued, stats.running, stats.failed, stats.completed) == (0, 0, 1, 1)


def test_an_admission_error_fails_only_its_row():
    backend = IterativeBomb(ValueError, "admit")
    with Serving.new(backend).start(batch_size=8, batch_timeout=0.2) as h:
        streams = [h.stream(countdown(n)) for n in (3, 13, 4)]  # admitted together (one window)
        good = [list(streams[0]), list(streams[2])]
        with pytest.raises(BackendError):
            list(streams[1])
        assert [len(g) for g in good] == [3, 4]
        assert backend.attempts[0] == 3  # they did arrive as one group
        assert (h.stats().failed, h.stats().completed, h.stats().running) == (1, 2, 0)


def test_finished_requests_with_long_deadlines_do_not_accumulate():
    """RSS stays flat over 10,000 requests with a one-hour deadline (each used to stay in the
    deadline heap, ~20 KB, until its deadline passed)."""

    def rss_mb() -> float:
        return peak_rss_kib() / 1024

    with Serving.new(CountdownBackend()).start(batch_size=8, batch_timeout=0.0) as h:
        for _ in range(2_000):
            h.run(countdown(1), deadline=3600)
        before = rss_mb()
        for _ in range(10_000):
            h.run(countdown(1), deadline=3600)
        grown = rss_mb() - before
        assert len(h._scheduler._deadlines) <= 64
    assert grown < 20, f"RSS grew {grown:.1f} MB over 10,000 requests"
