"""Time values at the limits: a deadline too far to represent is no deadline (it used to raise
OverflowError from the blocking waits), and the serving's timeouts refuse NaN, infinities and
non-numbers by name (NaN and inf were accepted and then broke ``close()``)."""

from __future__ import annotations

import math

import anyio
import pytest

from mlx_serving import ProcessOptions, Serving
from serving_fakes import CountdownBackend, RecordingBackend, countdown, rows


@pytest.mark.parametrize("deadline", [1e10, 1e12, 1e300])
def test_a_deadline_past_any_wait_is_no_deadline(deadline: float):
    static, iterative = Serving.new(RecordingBackend()), Serving.new(CountdownBackend())
    assert Serving.run(static, rows(1.0), deadline=deadline).tolist() == [2.0]
    assert Serving.run(iterative, countdown(2), deadline=deadline) == [(0, 1), (0, 0)]
    with static.start(batch_size=2) as h:
        assert h.run(rows(1.0), deadline=deadline).tolist() == [2.0]
        assert list(h.stream(rows(3.0), deadline=deadline))
    with iterative.start(batch_size=2) as h:
        assert h.run(countdown(1), deadline=deadline) == [(0, 0)]

        async def run_async() -> object:
            return await h.run_async(countdown(1), deadline=deadline)

        assert anyio.run(run_async) == [(0, 0)]


@pytest.mark.parametrize("name", ["batch_timeout", "shutdown_timeout"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 2e9, "1", True, None])
def test_timeouts_must_be_finite_seconds(name: str, value: object):
    with pytest.raises(ValueError, match=name):
        ProcessOptions(**{name: value})  # type: ignore[arg-type]  # the wrong types are the point
    if value is not None:  # start(...=None) keeps the default
        with pytest.raises(ValueError, match=name):
            Serving.new(RecordingBackend()).start(**{name: value})


@pytest.mark.parametrize("name", ["batch_timeout", "shutdown_timeout"])
def test_timeouts_in_range_are_kept(name: str):
    for value in (0, 0.5, 1e9):
        assert getattr(ProcessOptions(**{name: value}), name) == value
