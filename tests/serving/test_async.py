import threading
import time

import anyio
import numpy as np
import pytest

from mlx_serving.serving import DeadlineExceeded, Serving, ServingOverloaded, ServingStopped
from serving_fakes import GateBackend, RecordingBackend, rows

pytestmark = pytest.mark.anyio


async def test_run_async_does_model_work_on_the_servings_executor_thread(recording):
    s = Serving.new(recording, "arg").batch_size(2)
    loop_thread = threading.current_thread().name
    out = await Serving.run_async(s, rows(1, 2, 3))
    assert out.tolist() == [2, 4, 6]
    assert await s.run_async(rows(4)) == np.array([8])
    assert recording.threads == {"serving-inline"} and loop_thread not in recording.threads
    assert len(recording.inits) == 1


#: Only ends a hang: how long a backend waits for the event loop to tick (it ticks every 10 ms
#: unless something blocks it).
_HANG_S = 60.0


class _Ticks:
    """Heartbeats of the event loop, counted; ``wait(n)`` (on another thread) blocks until ``n`` more
    beats came, so work that waits for them can only finish if the loop runs meanwhile: a count,
    not a duration, which no load on the machine can make flaky."""

    def __init__(self) -> None:
        self.count = 0

    async def beat(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            await anyio.sleep(0.01)
            self.count += 1

    def wait(self, n: int) -> bool:
        """True once ``n`` more beats came; False if the loop stayed blocked for ``_HANG_S``."""
        target, end = self.count + n, time.monotonic() + _HANG_S
        while self.count < target:
            if time.monotonic() > end:
                return False
            time.sleep(0.002)
        return True


async def _with_heartbeat(ticks: _Ticks, coro_fn) -> object:
    """``await coro_fn()`` while ``ticks`` counts the loop's heartbeats."""
    async with anyio.create_task_group() as tg:
        stop = anyio.Event()
        tg.start_soon(ticks.beat, stop)
        try:
            return await coro_fn()
        finally:
            stop.set()


class _TickingBackend(RecordingBackend):
    """A batch ends only after the event loop ticked 3 times while it ran (it would never end if it
    ran on the loop); ``saw_ticks`` records, per batch, whether they came."""

    def __init__(self, ticks: _Ticks) -> None:
        super().__init__()
        self.ticks, self.saw_ticks = ticks, []

    def handle_batch(self, batch, partition, state):
        self.saw_ticks.append(self.ticks.wait(3))
        return super().handle_batch(batch, partition, state)


async def test_batched_run_async_batches_concurrent_tasks_and_keeps_the_loop_free():
    ticks = _Ticks()
    backend = _TickingBackend(ticks)
    results = {}

    async def call(i):
        results[i] = (await Serving.batched_run_async(h, rows(i))).tolist()

    async def calls():
        with anyio.fail_after(2 * _HANG_S):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(call, i)

    async with Serving.new(backend).start(batch_size=8, batch_timeout=_HANG_S) as h:
        await _with_heartbeat(ticks, calls)
    assert results == {i: [2 * i] for i in range(8)}
    assert len(backend.batches) == 1 and sorted(backend.batches[0][0]) == list(range(8))
    assert backend.saw_ticks == [True]  # the loop ticked while the batch ran


async def test_cancelled_while_queued_never_runs():
    backend = GateBackend()
    async with Serving.new(backend).start(batch_size=1, batch_timeout=0) as h:
        async with anyio.create_task_group() as tg:
            tg.start_soon(Serving.batched_run_async, h, rows(1))
            await anyio.to_thread.run_sync(backend.wait_started)
            with anyio.move_on_after(0.2) as scope:
                await Serving.batched_run_async(h, rows(2))
            assert scope.cancelled_caught
            stats = h.stats()
            assert (stats.queued, stats.cancelled) == (0, 1)
            backend.gate.set()
        assert (await Serving.batched_run_async(h, rows(3))).tolist() == [6]
    assert [b[0] for b in backend.batches] == [[1], [3]]


async def test_inline_run_async_cancelled_while_queued_never_runs():
    backend = GateBackend()
    s = Serving.new(backend)
    async with anyio.create_task_group() as tg:
        tg.start_soon(s.run_async, rows(1))
        await anyio.to_thread.run_sync(backend.wait_started)
        with anyio.move_on_after(0.2):
            await s.run_async(rows(2))
        backend.gate.set()
    assert (await s.run_async(rows(3))).tolist() == [6]
    assert [b[0] for b in backend.batches] == [[1], [3]]


async def test_deadline_and_overload_async():
    backend = GateBackend()
    async with Serving.new(backend).start(batch_size=1, batch_timeout=0, max_queue=1) as h:
        async with anyio.create_task_group() as tg:
            tg.start_soon(Serving.batched_run_async, h, rows(1))
            await anyio.to_thread.run_sync(backend.wait_started)
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded):  # the gate is shut: only the deadline ends this call
                with anyio.fail_after(_HANG_S):
                    await Serving.batched_run_async(h, rows(2), deadline=0.2)
            assert 0.15 < time.monotonic() - start  # not before its deadline
            async with anyio.create_task_group() as queued:
                queued.start_soon(Serving.batched_run_async, h, rows(3))
                with anyio.fail_after(_HANG_S):
                    while h.stats().queued == 0:
                        await anyio.sleep(0.01)
                with pytest.raises(ServingOverloaded):
                    await Serving.batched_run_async(h, rows(4))
                backend.gate.set()
        stats = h.stats()
        assert (stats.expired, stats.rejected, stats.completed) == (1, 1, 2)


async def test_static_stream_yields_each_chunk(recording):
    async with Serving.new(recording).start(batch_size=2, batch_timeout=0.01) as h:
        chunks = [out.tolist() async for out, _meta in await Serving.stream_async(h, rows(1, 2, 3))]
    assert chunks == [[2, 4], [6]]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_wait_for_and_task_cancel_withdraw_queued_requests(anyio_backend):
    import asyncio

    backend = GateBackend()
    async with Serving.new(backend).start(batch_size=1, batch_timeout=0) as h:
        running = asyncio.ensure_future(Serving.batched_run_async(h, rows(1)))
        await anyio.to_thread.run_sync(backend.wait_started)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(Serving.batched_run_async(h, rows(2)), 0.1)
        task = asyncio.ensure_future(Serving.batched_run_async(h, rows(3)))
        await anyio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (h.stats().queued, h.stats().cancelled) == (0, 2)
        backend.gate.set()
        assert (await running).tolist() == [2]
    assert [b[0] for b in backend.batches] == [[1]]


class _SlowInit(RecordingBackend):
    """A backend whose init takes 0.4 s (loading, warm-up)."""

    def init(self, mode, arg, partitions):
        time.sleep(0.4)
        return super().init(mode, arg, partitions)


class _TickingInit(RecordingBackend):
    """A backend whose init ends only after the event loop ticked 3 times while it ran (loading,
    warm-up); ``saw_ticks`` records whether they came."""

    def __init__(self, ticks: _Ticks) -> None:
        super().__init__()
        self.ticks, self.saw_ticks = ticks, []

    def init(self, mode, arg, partitions):
        self.saw_ticks.append(self.ticks.wait(3))
        return super().init(mode, arg, partitions)


async def test_start_async_runs_init_off_the_loop_and_returns_a_working_handle():
    ticks = _Ticks()
    backend = _TickingInit(ticks)
    handle = await _with_heartbeat(ticks, lambda: Serving.start_async(Serving.new(backend).batch_size(4),
                                                                      batch_timeout=0.01))
    assert backend.saw_ticks == [True], "the event loop did not tick while init ran"
    async with handle:
        assert (await Serving.batched_run_async(handle, rows(3))).tolist() == [6]


async def test_start_async_cancelled_during_init_leaves_nothing_running():
    backend = _SlowInit()
    with anyio.move_on_after(0.1):
        await Serving.new(backend).start_async("cancelled-start")
    assert len(backend.inits) == 1  # init ran to its end...
    with pytest.raises(ServingStopped):  # ...and the handle it made was stopped, its name freed
        await Serving.batched_run_async("cancelled-start", rows(1))
