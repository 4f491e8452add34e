"""The client contract: the inline serving and a started handle answer the same verbs with the
same semantics (the pool's side is in tests/pool/test_pool_contract.py)."""

from __future__ import annotations

import gc
import threading
import time
import warnings

import anyio
import pytest

from mlx_serving.serving import (
    AsyncStream,
    BackendError,
    Client,
    DeadlineExceeded,
    Serving,
    ServingStats,
    ServingStopped,
    Stream,
)
from mlx_serving.serving._channel import Channel
from serving_fakes import CountdownBackend, countdown

#: Wall-clock caps here only end a hang (the awaited work takes milliseconds): room for cores shared
#: with other busy processes. What the tests assert is counted, never timed against this.
HANG_S = 60.0


def wait_for(predicate, timeout=HANG_S):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.005)


@pytest.fixture(params=["inline", "handle"])
def client(request):
    """A Client over a slow countdown backend: the inline serving or a started handle."""
    serving = Serving.new(CountdownBackend(step_delay=0.01))
    target = serving if request.param == "inline" else serving.start(batch_size=4, batch_timeout=0.0)
    with target:
        yield target


def test_both_are_clients_and_answer_alike(client):
    assert isinstance(client, Client)
    assert [e for _, e in client.run(countdown(3))] == [2, 1, 0]
    with client.stream(countdown(2)) as stream:
        assert isinstance(stream, Stream)
        assert [e for _, e in stream] == [1, 0]
    stats = client.stats()
    assert isinstance(stats, ServingStats)
    assert (stats.completed, stats.queued, stats.running) == (2, 0, 0)


def test_a_stream_is_submitted_when_made(client):
    stream = client.stream(countdown(50))
    try:
        wait_for(lambda: client.stats().running == 1)  # nobody called next() yet
    finally:
        stream.close()
    wait_for(lambda: client.stats().running == 0)
    assert client.stats().cancelled == 1


def test_deadline_and_errors_carry_the_request_id(client):
    stream = client.stream(countdown(1000), deadline=0.05)
    with pytest.raises(DeadlineExceeded) as info:
        list(stream)
    assert info.value.request_id == stream.request_id


def test_closed_clients_refuse(client):
    client.close()
    with pytest.raises(ServingStopped):
        client.run(countdown(1))


def test_async_verbs(client):
    async def main():
        assert [e for _, e in await client.run_async(countdown(2))] == [1, 0]
        stream = await client.stream_async(countdown(2))
        assert isinstance(stream, AsyncStream)
        async with stream:
            assert [e async for _, e in stream] == [1, 0]
        long = await client.stream_async(countdown(1000))
        with anyio.move_on_after(0.05):  # the reading task is cancelled: the request is withdrawn
            async for _ in long:
                pass
        await anyio.to_thread.run_sync(wait_for, lambda: client.stats().running == 0)

    anyio.run(main)
    assert client.stats().cancelled == 1


def test_a_plain_for_over_an_async_stream_raises_instead_of_blocking():
    async def main():
        async with Serving.new(CountdownBackend()).start() as h:
            stream = await h.stream_async(countdown(2))
            with pytest.raises(TypeError, match="async for"):
                for _ in stream:  # noqa: B007
                    pass
            await stream.aclose()

    anyio.run(main)


def test_static_entry_points_are_thin_calls_onto_the_contract():
    serving = Serving.new(CountdownBackend())
    with serving.start(name="contract") as h:
        assert Serving.batched_run("contract", countdown(2)) == h.run(countdown(2))
        assert Serving.batched_run(serving, countdown(2)) == serving.run(countdown(2))  # inline
        with Serving.stream(h, countdown(1)) as s:
            assert list(s) == [(0, 0)]
    serving.close()


def test_a_dropped_stream_warns_and_is_withdrawn(client):
    stream = client.stream(countdown(10_000))
    wait_for(lambda: client.stats().running == 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del stream
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    wait_for(lambda: client.stats().running == 0)
    assert client.stats().cancelled == 1


def test_a_cancelled_async_reader_removes_its_waker():
    channel = Channel()

    async def main():
        with anyio.move_on_after(0.01):
            await channel.aget()
        assert channel.waiters() == 0
        for _ in range(100):  # without the removal, wake-up callbacks pile up per cancelled wait
            with anyio.move_on_after(0):
                await channel.aget()
        assert channel.waiters() == 0

    anyio.run(main)


def test_offload_runs_long_preprocessing_off_the_event_loop():
    threads: list[str] = []

    def pre(input):
        threads.append(threading.current_thread().name)
        return countdown(input), None

    serving = Serving.new(CountdownBackend()).client_preprocessing(pre, offload=lambda n: n > 2)

    async def main():
        loop_thread = threading.current_thread().name
        with serving:
            await serving.run_async(1)
            await (await serving.stream_async(3)).aclose()
        return loop_thread

    loop_thread = anyio.run(main)
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_backend_errors_carry_the_request_id():
    with Serving.new(CountdownBackend(fail_on=1)) as serving:
        stream = serving.stream(countdown(3))
        with pytest.raises(BackendError) as info:
            list(stream)
        assert info.value.request_id == stream.request_id


class StopAtTwo:
    """Transducer: stops every row once it emitted event 2 (a client-side stop, as a stop string)."""

    def __init__(self, info):
        self.stops = []

    def feed(self, row, event):
        if event == 2:
            self.stops.append(row)
        return [event]

    def stop_rows(self):
        stops, self.stops = self.stops, []
        return stops

    def close(self):
        return []


def test_inline_runs_back_to_back_after_a_client_side_stop():
    """Each inline run has its own scheduler: the next call's rows never reach a run that is
    still draining (they once made it spin, holding the executor)."""
    with Serving.new(CountdownBackend(step_delay=0.005)).streaming(StopAtTwo) as serving:
        for _ in range(10):
            with serving.stream(countdown(6)) as stopped:
                assert list(stopped) == [5, 4, 3, 2]
            assert serving.run(countdown(2)) == [1, 0]
        assert serving.stats().completed == 20


class CountingCountdown(CountdownBackend):
    """A countdown backend reporting its own counter (rows admitted) through ``stats(state)``."""

    def admit(self, state, rows, partition):
        state["admitted"] = state.get("admitted", 0) + len(rows)
        return super().admit(state, rows, partition)

    def stats(self, state):
        return {"admitted": state.get("admitted", 0)}


def test_backend_counters_reach_stats_summed_over_partitions():
    serving = Serving.new(CountingCountdown())
    assert serving.run(countdown(1, 2)) and serving.stats().backend == {"admitted": 2}
    with serving.start(partitions=2, batch_size=4, batch_timeout=0.0) as h:
        for n in range(1, 6):
            h.run(countdown(n))
        assert h.stats().backend == {"admitted": 5}
    serving.close()


def test_take_ready_returns_what_has_arrived_without_waiting():
    """AsyncStream.take_ready: [] before anything arrives; once the request has finished, every
    remaining item in order, after which iteration stops; items equal plain iteration's."""
    serving = Serving.new(CountdownBackend(step_delay=0.01))

    async def main():
        with serving.start(batch_size=4, batch_timeout=0.0) as handle:
            async with await handle.stream_async(countdown(6)) as stream:
                first = await stream.__anext__()
                wait_for(lambda: handle.stats().completed == 1)  # everything has arrived
                rest = stream.take_ready()
                assert [e for _, e in [first, *rest]] == [5, 4, 3, 2, 1, 0]
                assert stream.take_ready() == []
                assert [item async for item in stream] == []
            async with await handle.stream_async(countdown(200)) as stream:
                assert stream.take_ready() == []  # nothing yet: no wait, no item

    anyio.run(main)


def test_channel_take_ready_ends_with_end_or_raises():
    from mlx_serving.serving._channel import END

    channel = Channel()
    assert channel.take_ready() == []
    channel.put(1)
    channel.put(2)
    assert channel.take_ready() == [1, 2]
    channel.put(3)
    channel.close()
    assert channel.take_ready() == [3, END]
    failed = Channel()
    failed.put(1)
    failed.close(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        failed.take_ready()
