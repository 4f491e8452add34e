"""Burst reads and deferred wake-ups: a channel hands every message that has arrived in one call
(``get_all`` / ``aget_all``), and a stream that read a burst still consumes it message by message
(a consumer's error or stop comes exactly where reading one message at a time puts it); a writer
that puts on many channels (a decode step's rows) wakes their readers with one call per event
loop (``put(..., deferred)`` then ``wake``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from mlx_serving.serving import RequestCancelled, Serving, Stream
from mlx_serving.serving._channel import END, Channel, Waker, wake
from mlx_serving.serving._client import IterativeConsumer
from mlx_serving.serving._messages import RowEvent
from mlx_serving.serving._request import Request
from serving_fakes import CountdownBackend, countdown

#: Wall-clock caps here only end a hang (the awaited work takes milliseconds): room for cores shared
#: with other busy processes. What the tests assert is counted, never timed against this.
HANG_S = 60.0


def test_get_all_takes_every_arrived_message_then_end_or_the_error() -> None:
    channel = Channel()
    with pytest.raises(TimeoutError):
        channel.get_all(0)
    channel.put(1)
    channel.put(2)
    assert channel.get_all(0) == [1, 2]
    channel.put(3)
    channel.close()
    assert channel.get_all() == [3, END]
    assert channel.get_all() == [END]
    failed = Channel()
    failed.put(1)
    failed.close(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        failed.get_all()


def test_held_channel_gives_everything_at_the_close() -> None:
    channel = Channel()
    channel.hold_until_close()
    channel.put(1)
    with pytest.raises(TimeoutError):
        channel.get_all(0.01)
    channel.put(2)
    channel.close()
    assert channel.get_all(0) == [1, 2, END]


def test_a_blocked_reader_is_woken_by_a_put_from_another_thread() -> None:
    channel = Channel()
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.extend(channel.get_all(5)))
    reader.start()
    time.sleep(0.05)  # the reader is waiting
    channel.put("x")
    reader.join(5)
    assert got == ["x"]
    reader = threading.Thread(target=lambda: got.append(channel.get(5)))
    reader.start()
    time.sleep(0.05)
    channel.close()
    reader.join(5)
    assert got == ["x", END]


@pytest.mark.anyio
async def test_aget_all_is_woken_by_a_put_from_another_thread() -> None:
    channel = Channel()
    timer = threading.Timer(0.05, lambda: (channel.put(1), channel.put(2), channel.close()))
    timer.start()
    got: list[Any] = []
    with anyio.fail_after(HANG_S):
        while not got or got[-1] is not END:  # the puts may land across several bursts
            got += await channel.aget_all()
    timer.join()
    assert got == [1, 2, END]
    assert channel.waiters() == 0


@pytest.mark.anyio
async def test_a_cancelled_reader_leaves_no_wake_up_and_the_channel_still_works() -> None:
    channel = Channel()
    for _ in range(20):
        with anyio.move_on_after(0.001):
            await channel.aget_all()
    assert channel.waiters() == 0
    threading.Timer(0.02, channel.put, ("x",)).start()
    with anyio.fail_after(HANG_S):
        assert await channel.aget_all() == ["x"]


@pytest.mark.anyio
async def test_deferred_wake_ups_wait_for_wake_then_take_one_call_per_loop(anyio_backend: str) -> None:
    channels = [Channel() for _ in range(8)]
    got: dict[int, list[Any]] = {}
    calls: list[int] = []
    if anyio_backend == "asyncio":  # count the loop's thread-safe "call soon"s
        import asyncio

        loop = asyncio.get_running_loop()
        call_soon = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(1), call_soon(*a))[1]  # type: ignore[method-assign]

    async def read(i: int) -> None:
        got[i] = await channels[i].aget_all()

    def writer(deferred: list[Waker]) -> None:
        for i, channel in enumerate(channels):
            channel.put(i, deferred)

    with anyio.fail_after(HANG_S):
        async with anyio.create_task_group() as tg:
            for i in range(len(channels)):
                tg.start_soon(read, i)
            while sum(c.waiters() for c in channels) < len(channels):
                await anyio.sleep(0.001)
            deferred: list[Waker] = []
            await anyio.to_thread.run_sync(writer, deferred)
            assert len(deferred) == len(channels) and sum(c.waiters() for c in channels) == 0
            await anyio.sleep(0.02)
            assert got == {}  # nobody woken before wake()
            woken_with = await anyio.to_thread.run_sync(_calls_made_by, wake, deferred, calls)
    assert got == {i: [i] for i in range(len(channels))}
    if anyio_backend == "asyncio":
        assert woken_with == 1


def _calls_made_by(fn: Any, arg: Any, calls: list[int]) -> int:
    before = len(calls)
    fn(arg)
    return len(calls) - before


class _FailAt:
    """A transducer whose ``feed`` raises at the event ``fail_at`` (the row's count down value)."""

    live = True

    def __init__(self, fail_at: int):
        self.fail_at = fail_at

    def feed(self, row_index: int, event: Any) -> list[Any]:
        if event == self.fail_at:
            raise ValueError(f"bad event {event}")
        return [event]

    def stop_rows(self) -> list[int]:
        return []

    def close(self) -> list[Any]:
        return []


def _done_then_read(handle: Any, n: int, fail_at: int) -> tuple[list[Any], BaseException | None]:
    """Every event of a ``n``-step row is on the channel (one burst) before the stream is read."""
    items: list[Any] = []
    with handle.stream(countdown(n)) as stream:
        deadline = time.monotonic() + HANG_S
        while not stream._request.done:
            assert time.monotonic() < deadline, "the request never finished"
            time.sleep(0.005)
        try:
            for item in stream:
                items.append(item)
        except ValueError as e:
            return items, e
    return items, None


def test_a_consumer_error_comes_after_the_items_before_it_in_a_burst() -> None:
    serving = Serving.new(CountdownBackend()).streaming(lambda info: _FailAt(fail_at=2))
    with serving.start(batch_size=4, batch_timeout=0.0) as handle:
        items, error = _done_then_read(handle, 6, fail_at=2)
    assert items == [5, 4, 3] and isinstance(error, ValueError)


@pytest.mark.anyio
async def test_async_stream_of_a_burst_yields_in_order_and_result_reads_it_whole() -> None:
    serving = Serving.new(CountdownBackend()).streaming(lambda info: _FailAt(fail_at=-1))
    with serving.start(batch_size=4, batch_timeout=0.0) as handle:
        async with await handle.stream_async(countdown(5)) as stream:
            with anyio.fail_after(HANG_S):
                while not stream._request.done:
                    await anyio.sleep(0.005)
            assert [item async for item in stream] == [4, 3, 2, 1, 0]
        assert await handle.run_async(countdown(7)) == [6, 5, 4, 3, 2, 1, 0]


def _burst_stream(fail_at: int) -> Stream:
    """A running request (no runtime behind it) with three events queued: 5, 4, 3."""
    request = Request(1, None)
    for value in (5, 4, 3):
        request.channel.put(RowEvent(0, value))
    return Stream(request, IterativeConsumer(request, _FailAt(fail_at)))


def test_after_a_consumer_error_the_rest_of_the_burst_is_dropped_with_the_request() -> None:
    stream = _burst_stream(fail_at=4)
    assert next(stream) == 5  # took the whole burst, consumed one message
    with pytest.raises(ValueError):
        next(stream)
    with pytest.raises(RequestCancelled):  # as reading message by message: the channel failed
        next(stream)


def test_closing_drops_the_taken_messages_of_a_running_request() -> None:
    stream = _burst_stream(fail_at=-1)
    assert next(stream) == 5
    stream.close()
    with pytest.raises(RequestCancelled):
        next(stream)
