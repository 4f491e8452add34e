import gc
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import pytest

from mlx_serving.serving import BackendError, DeadlineExceeded, Serving, ServingOverloaded
from serving_fakes import CountdownBackend, QueueingCountdown, countdown

#: Wall-clock caps here only end a hang (the awaited work takes milliseconds): room for cores shared
#: with other busy processes. What the tests assert is counted, never timed against this.
HANG_S = 60.0


def per_row(items):
    """Group default-transducer items (row_index, event) by row."""
    out = {}
    for index, event in items:
        out.setdefault(index, []).append(event)
    return out


def wait_for(predicate, timeout=HANG_S):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        threading.Event().wait(0.005)


class Collect:
    """Transducer: items are 'row:event' strings; stops a row once it emitted ``stop_at``."""

    def __init__(self, info, stop_at=None):
        self.info, self.stop_at, self.pending_stops = info, stop_at, []

    def feed(self, row, event):
        if event == self.stop_at:
            self.pending_stops.append(row)
        return [f"{row}:{event}"]

    def stop_rows(self):
        stops, self.pending_stops = self.pending_stops, []
        return stops

    def close(self):
        return ["end"]


def test_inline_run_admits_all_and_steps_until_done():
    backend = CountdownBackend()
    s = Serving.new(backend).streaming(Collect).client_postprocessing(lambda r, info: (r[0], info))
    items, info = s.run(countdown(3, 1))
    assert items == ["0:2", "1:0", "0:1", "0:0", "end"] and info is None
    assert backend.admissions == [[0, 1]] and backend.inits == [("inline", 1)]


def test_transducer_stop_rows_cancels_the_row_and_ends_the_request():
    backend = CountdownBackend(step_delay=0.01)
    s = Serving.new(backend).streaming(lambda info: Collect(info, stop_at=7))
    with s.start(batch_size=4, batch_timeout=0) as h:
        items = Serving.batched_run(h, countdown(10, 2))
        assert items == ["0:9", "1:1", "0:8", "1:0", "0:7", "end"]
        wait_for(lambda: backend.cancelled == [0])  # cancelled on the executor before its next step
        assert sum(0 in step for step in backend.steps) < 10
        assert h.stats().completed == 1 and h.stats().running == 0


def test_admission_window_shares_one_admission_when_idle():
    """Two requests 0.15 s apart, on an idle serving with a window longer than any busy machine's
    delay between them (it closes when the batch is full): one admission of both."""
    backend = CountdownBackend()
    with Serving.new(backend).start(batch_size=2, batch_timeout=60) as h, ThreadPoolExecutor(2) as pool:
        a = pool.submit(Serving.batched_run, h, countdown(2))
        time.sleep(0.15)
        b = pool.submit(Serving.batched_run, h, countdown(3))
        assert per_row(a.result(5)) == {0: [1, 0]} and per_row(b.result(5)) == {0: [2, 1, 0]}
    assert len(backend.admissions[0]) == 2


def test_staggered_arrivals_join_between_steps_and_short_rows_finish_first():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(batch_size=4, batch_timeout=0) as h, ThreadPoolExecutor(2) as pool:
        long = pool.submit(Serving.batched_run, h, countdown(60))
        wait_for(lambda: len(backend.steps) >= 5)
        short = Serving.batched_run(h, countdown(3))
        assert not long.done()  # the short request did not wait for the long one
        assert per_row(short) == {0: [2, 1, 0]}
        assert per_row(long.result(10)) == {0: list(range(59, -1, -1))}
    assert [0, 1] in backend.steps  # shared steps
    assert backend.admissions == [[0], [1]]


def test_cancel_mid_run_leaves_others_unchanged_and_active_drops_within_one_step():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(batch_size=4, batch_timeout=0.05) as h, ThreadPoolExecutor(2) as pool:
        others = [pool.submit(Serving.batched_run, h, countdown(12)) for _ in range(2)]
        stream = Serving.stream(h, countdown(12))
        assert [next(stream), next(stream), next(stream)] == [(0, 11), (0, 10), (0, 9)]
        stream.close()
        started = len(backend.steps)
        results = [f.result(5) for f in others]
    cancelled_id = backend.cancelled[0]
    assert all(cancelled_id not in step for step in backend.steps[started:])
    assert all(per_row(r) == {0: list(range(11, -1, -1))} for r in results)
    assert h.stats().cancelled == 1


def test_breaking_out_of_a_stream_after_two_items_frees_its_row():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(batch_size=4, batch_timeout=0.05) as h, ThreadPoolExecutor(1) as pool:
        other = pool.submit(Serving.batched_run, h, countdown(15))
        for i, _item in enumerate(Serving.stream(h, countdown(15))):
            if i == 1:
                break
        wait_for(lambda: len(backend.cancelled) == 1)
        assert backend.active(backend.states[0]) <= 1 and h.stats().running <= 1
        assert per_row(other.result(5)) == {0: list(range(14, -1, -1))}


def test_garbage_collected_stream_frees_its_row():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(batch_size=4, batch_timeout=0) as h:
        stream = Serving.stream(h, countdown(50))
        next(stream)
        del stream
        gc.collect()
        wait_for(lambda: h.stats().running == 0 and backend.cancelled)
        assert h.stats().cancelled == 1


def test_free_slots_make_rows_wait_for_admission():
    backend = CountdownBackend(slots=2)
    with Serving.new(backend).start(batch_size=8, batch_timeout=0.05) as h, ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(Serving.batched_run, h, countdown(4)) for _ in range(5)]
        assert all(per_row(f.result(5)) == {0: [3, 2, 1, 0]} for f in futures)
    assert max(len(step) for step in backend.steps) == 2
    assert sum(len(a) for a in backend.admissions) == 5


def test_rows_that_never_fit_fail_only_their_caller():
    backend = CountdownBackend(max_steps=5)
    with Serving.new(backend).start(batch_size=4, batch_timeout=0.2) as h, ThreadPoolExecutor(2) as pool:
        ok = pool.submit(Serving.batched_run, h, countdown(3))
        bad = pool.submit(Serving.batched_run, h, countdown(2, 50))
        assert per_row(ok.result(5)) == {0: [2, 1, 0]}
        with pytest.raises(ValueError, match="never fits"):
            bad.result(5)
        wait_for(lambda: len(backend.cancelled) == 1)  # the bad request's other row was removed
        assert h.stats().rejected == 1 and h.stats().running == 0


def test_deadline_cancels_a_running_row():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(batch_size=2, batch_timeout=0) as h:
        with pytest.raises(DeadlineExceeded):
            Serving.batched_run(h, countdown(1000), deadline=0.2)
        wait_for(lambda: backend.cancelled)
        assert h.stats().running == 0 and h.stats().expired == 1


def test_step_error_fails_the_rows_in_that_step_and_the_loop_goes_on():
    backend = CountdownBackend(fail_on=97)
    with Serving.new(backend).start(batch_size=2, batch_timeout=0.1) as h, ThreadPoolExecutor(2) as pool:
        bad = pool.submit(Serving.batched_run, h, countdown(98))
        mate = pool.submit(Serving.batched_run, h, countdown(3))
        for f in (bad, mate):
            with pytest.raises(BackendError) as info:
                f.result(5)
            assert isinstance(info.value.__cause__, RuntimeError)
        assert per_row(Serving.batched_run(h, countdown(2))) == {0: [1, 0]}


def test_max_queue_for_iterative_servings():
    backend = CountdownBackend(slots=1, step_delay=0.01)
    with Serving.new(backend).start(batch_size=1, batch_timeout=0, max_queue=1) as h, ThreadPoolExecutor(2) as pool:
        running = pool.submit(Serving.batched_run, h, countdown(30))
        wait_for(lambda: h.stats().running == 1)
        queued = pool.submit(Serving.batched_run, h, countdown(2))
        wait_for(lambda: h.stats().queued == 1)
        with pytest.raises(ServingOverloaded):
            Serving.batched_run(h, countdown(1))
        assert len(running.result(5)) == 30 and len(queued.result(5)) == 2


def test_a_queueing_backend_holds_the_one_queue_orders_it_and_counts_it_as_queued():
    """One slot, busy: three requests queue (9, 7 then 5 steps); the serving hands them all to the
    backend, which starts the shortest first; they count as queued at once (max_queue included),
    and a withdrawn one leaves the queued count at once."""
    backend = QueueingCountdown(slots=1, step_delay=0.001)
    with Serving.new(backend).start(batch_size=1, batch_timeout=0, max_queue=3) as h, ThreadPoolExecutor(2) as pool:
        with Serving.stream(h, countdown(1_000_000)) as busy:  # closed even when an assertion fails
            next(busy)
            nine = pool.submit(Serving.batched_run, h, countdown(9))
            wait_for(lambda: h.stats().queued == 1)
            seven = Serving.stream(h, countdown(7))
            wait_for(lambda: h.stats().queued == 2)
            five = pool.submit(Serving.batched_run, h, countdown(5))
            wait_for(lambda: backend.waiting(backend.states[0]) == 3)  # all three in the backend's queue
            stats = h.stats()
            assert (stats.queued, stats.running, stats.rows_in_flight) == (3, 1, 4)
            with pytest.raises(ServingOverloaded):
                Serving.batched_run(h, countdown(1))
            seven.close()  # withdrawn while waiting in the backend
            stats = h.stats()
            assert (stats.queued, stats.running, stats.cancelled) == (2, 1, 1)
        assert per_row(five.result(10)) == {0: [4, 3, 2, 1, 0]} and len(nine.result(10)) == 9
        wait_for(lambda: h.stats().rows_in_flight == 0)
        stats = h.stats()
    assert backend.started == [0, 3, 1]  # row ids in arrival order: busy, 9, 7, 5; the backend's order
    assert (stats.queued, stats.running, stats.completed, stats.cancelled) == (0, 0, 2, 2)


def test_batch_size_below_a_queueing_backends_capacity_bounds_the_rows_running():
    """The backend could run 4 rows at once (its free_slots when idle) but batch_size is 2: the
    serving holds it to 2 rows, so no more than 2 ever run; every row still completes."""
    backend = QueueingCountdown(slots=4, step_delay=0.001)
    with Serving.new(backend).start(batch_size=2, batch_timeout=0.05) as h:
        per = per_row(Serving.batched_run(h, countdown(5, 4, 3, 2, 1, 6)))
        stats = h.stats()
    assert per == {i: list(range(n - 1, -1, -1)) for i, n in enumerate((5, 4, 3, 2, 1, 6))}
    assert backend.most_running == 2 and stats.completed == 1


def test_partitions_each_run_their_own_step_loop():
    backend = CountdownBackend(step_delay=0.01)
    with Serving.new(backend).start(name="iter", batch_size=1, batch_timeout=0, partitions=2) as h:
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda n: per_row(Serving.batched_run("iter", countdown(n))), (10, 10)))
    assert outs == [{0: list(range(9, -1, -1))}] * 2
    assert backend.inits == [("process", 2)] * 2
    assert backend.threads == {"iter-p0", "iter-p1"}
    assert h.stats().completed == 2


@pytest.mark.anyio
async def test_async_streams_break_aclose_and_share_steps():
    backend = CountdownBackend(step_delay=0.005)
    # The first step waits for all three rows (a full batch), however late a busy machine submits them.
    async with Serving.new(backend).start(batch_size=3, batch_timeout=HANG_S) as h:
        results = {}

        async def full():
            results["full"] = [item async for item in await Serving.stream_async(h, countdown(10))]

        async def broken():
            async for i, _ in _enumerate(await Serving.stream_async(h, countdown(10))):
                if i == 1:
                    break

        async def closed():
            stream = await Serving.stream_async(h, countdown(10))
            await stream.__anext__()
            await stream.aclose()

        with anyio.fail_after(HANG_S):
            async with anyio.create_task_group() as tg:
                for fn in (full, broken, closed):
                    tg.start_soon(fn)
            while len(backend.cancelled) < 2:
                await anyio.sleep(0.01)
        assert per_row(results["full"]) == {0: list(range(9, -1, -1))}
        assert len(backend.cancelled) == 2 and h.stats().cancelled == 2
        assert max(len(step) for step in backend.steps) == 3


async def _enumerate(aiter):
    i = 0
    async for item in aiter:
        yield i, item
        i += 1


@pytest.mark.anyio
@pytest.mark.parametrize("make", [lambda: CountdownBackend(slots=24, step_delay=0.001),
                                  lambda: QueueingCountdown(slots=16, step_delay=0.001)], ids=["plain", "queueing"])
async def test_200_random_concurrent_requests_with_random_cancellations_never_hang(make):
    """Every request ends, and every stats snapshot splits its rows in flight into queued and
    running, none negative and at most batch_size running (the queueing backend holds the queue)."""
    backend = make()
    rng = random.Random(1234)
    outcomes = {"ok": 0, "cancelled": 0, "expired": 0, "broken": 0}

    async def client(n, mode, delay):
        if mode == "cancel":
            with anyio.move_on_after(delay):
                await Serving.batched_run_async(h, countdown(n))
                outcomes["ok"] += 1
                return
            outcomes["cancelled"] += 1
        elif mode == "deadline":
            try:
                per = per_row(await Serving.batched_run_async(h, countdown(n), deadline=delay))
                assert per == {0: list(range(n - 1, -1, -1))}
                outcomes["ok"] += 1
            except DeadlineExceeded:
                outcomes["expired"] += 1
        elif mode == "break":
            async for _ in await Serving.stream_async(h, countdown(n)):
                break
            outcomes["broken"] += 1
        else:
            per = per_row(await Serving.batched_run_async(h, countdown(n)))
            assert per == {0: list(range(n - 1, -1, -1))}
            outcomes["ok"] += 1

    snapshots = []

    async def poll():
        while True:
            snapshots.append(h.stats())
            await anyio.sleep(0.001)

    async with Serving.new(backend).start(batch_size=16, batch_timeout=0.002, max_queue=1000) as h:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as outer:
                outer.start_soon(poll)
                async with anyio.create_task_group() as tg:
                    for _ in range(200):
                        mode = rng.choice(["run", "run", "cancel", "deadline", "break"])
                        tg.start_soon(client, rng.randint(1, 30), mode, rng.uniform(0.001, 0.05))
                        if rng.random() < 0.3:
                            await anyio.sleep(rng.uniform(0, 0.005))
                outer.cancel_scope.cancel()
            while h.stats().rows_in_flight:
                await anyio.sleep(0.01)
        stats = h.stats()
    assert sum(outcomes.values()) == 200
    assert outcomes["ok"] > 0 and outcomes["cancelled"] + outcomes["broken"] > 0
    assert stats.completed + stats.cancelled + stats.expired == 200
    assert all(backend.active(state) == 0 for state in backend.states)
    assert snapshots and all(0 <= s.running <= 16 and s.queued >= 0 and s.queued + s.running == s.rows_in_flight
                             for s in snapshots)
    assert getattr(backend, "most_running", 16) <= 16


class FeedLog(Collect):
    """Transducer recording, at each feed, how many steps the backend had run by then."""

    def __init__(self, info, backend, live):
        super().__init__(info)
        self.backend, self.live, self.seen = backend, live, []

    def feed(self, row, event):
        self.seen.append(len(self.backend.steps))
        return super().feed(row, event)


@pytest.mark.parametrize("live", [True, False])
def test_non_live_transducer_gets_its_events_in_one_burst_at_the_end(live):
    backend = CountdownBackend(step_delay=0.02)
    logs = []

    def factory(info):
        logs.append(FeedLog(info, backend, live))
        return logs[-1]

    s = Serving.new(backend).streaming(factory)
    with s.start(batch_size=2, batch_timeout=0) as h:
        assert Serving.batched_run(h, countdown(6)) == ["0:5", "0:4", "0:3", "0:2", "0:1", "0:0", "end"]
        streamed = list(Serving.stream(h, countdown(6)))
    assert streamed == ["0:5", "0:4", "0:3", "0:2", "0:1", "0:0", "end"]
    call, stream = logs
    # live: the caller saw the first event while later steps were still to run; not live: every
    # event arrived after the last step. Streams are always live.
    assert (call.seen[0] < 6) is live and (min(call.seen) == 6) is (not live)
    assert stream.seen[0] < 12


class ClosingBackend(CountdownBackend):
    """Records each ``close(state)``: the thread, the state, and whether steps came after it."""

    def __init__(self, fail: bool = False, fail_init_on: str | None = None, **kw: Any):
        super().__init__(**kw)
        self.fail, self.fail_init_on, self.closes = fail, fail_init_on, []

    def init(self, mode: str, arg: Any, partitions: int) -> dict:
        if threading.current_thread().name == self.fail_init_on:
            raise MemoryError("no room for this partition's state")
        return super().init(mode, arg, partitions)

    def close(self, state: dict) -> None:
        self.closes.append((threading.current_thread().name, state, len(self.steps)))
        if self.fail:
            raise RuntimeError("close failed")


def test_close_releases_each_partition_state_once_on_its_own_thread_after_its_loop():
    backend = ClosingBackend(step_delay=0.005)
    with Serving.new(backend).start(name="rel", batch_size=1, batch_timeout=0, partitions=2) as h:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda n: Serving.batched_run(h, countdown(n)), (5, 5)))
        assert backend.closes == []
    assert sorted(name for name, _, _ in backend.closes) == ["rel-p0", "rel-p1"]
    by_thread = {name: state for name, state, _ in backend.closes}
    assert {id(s) for s in by_thread.values()} == {id(s) for s in backend.states}
    assert all(after == len(backend.steps) for _, _, after in backend.closes)  # no step after a close


def test_a_raising_close_is_logged_and_the_serving_still_stops(caplog: pytest.LogCaptureFixture):
    backend = ClosingBackend(fail=True)
    h = Serving.new(backend).start(batch_size=1, batch_timeout=0)
    assert per_row(Serving.batched_run(h, countdown(2))) == {0: [1, 0]}
    h.close()
    assert len(backend.closes) == 1
    assert "IterativeBackend.close failed" in caplog.text


def test_when_one_partition_fails_to_init_the_built_ones_are_released_on_their_threads():
    backend = ClosingBackend(fail_init_on="half-p1")
    with pytest.raises(MemoryError, match="no room"):
        Serving.new(backend).start(name="half", batch_size=1, batch_timeout=0, partitions=2)
    deadline = time.monotonic() + HANG_S
    while not backend.closes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(name, state) for name, state, _ in backend.closes] == [("half-p0", backend.states[0])]
