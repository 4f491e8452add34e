"""ServingPool: results, routing, worker env, crashes, errors, cancellation, close, start failures."""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import numpy as np
import pool_servings
import pytest

from mlx_serving.serving import DeadlineExceeded, InvalidInput, RemoteError, ServingStopped, WorkerCrashed
from mlx_serving.serving import ServingPool


pytestmark = pytest.mark.timeout(600)  # a cap that only ends a hang (pyproject's 120 s is tight on a busy machine)


def child_pids() -> set[int]:
    """Live children of this process (zombies included until reaped)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        pids.update(int(pid) for pid in text)
    return pids


def wait_until(predicate, timeout: float = 120.0) -> None:
    """Poll until ``predicate()``; the cap only ends a hang (shared, busy machines are slow)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def double_pool():
    with ServingPool("pool_servings:double", workers=2, batch_size=8, batch_timeout=0.01) as pool:
        yield pool


@pytest.fixture(scope="module")
def sleeper_pool():
    with ServingPool("pool_servings:sleeper", workers=2, batch_size=4, batch_timeout=0.01) as pool:
        yield pool


@pytest.fixture(scope="module")
def counter_pool():
    with ServingPool("pool_servings:counter", workers=1, batch_size=4, batch_timeout=0.01) as pool:
        yield pool


def test_run_from_many_threads(double_pool):
    inputs = [np.full((i % 3 + 1, 3), i, dtype=np.float32) for i in range(24)]
    with ThreadPoolExecutor(12) as executor:
        outputs = list(executor.map(double_pool.run, inputs))
    for x, y in zip(inputs, outputs):
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, x * 2)


def test_static_stream_yields_batch_pieces(double_pool):
    x = np.arange(60, dtype=np.int64).reshape(20, 3)
    pieces = list(double_pool.stream(x))
    assert len(pieces) == 3  # batch_size 8: 8 + 8 + 4 rows
    np.testing.assert_array_equal(np.concatenate([output for output, _ in pieces]), x * 2)


def test_stats_add_up_the_workers(double_pool):
    before = double_pool.stats()
    for i in range(5):
        double_pool.run(np.ones((1, 2)))
    after = double_pool.pool_stats()
    assert after.total.completed - before.completed == 5
    assert sum(w.serving.completed for w in after.workers) == after.total.completed
    assert [w.index for w in after.workers] == [0, 1]
    assert double_pool.stats() == after.total


def test_health_reports_each_worker(double_pool):
    before = double_pool.health()
    double_pool.run(np.ones((1, 2)))
    double_pool.run(np.ones((1, 2)))
    after = double_pool.health()
    assert [h.index for h in after] == [0, 1]
    assert all(h.alive and h.state == "ready" and h.in_flight == 0 for h in after)
    assert all(h.pid not in (None, os.getpid()) for h in after)
    assert max(h.last_progress for h in after) > max(h.last_progress for h in before)


def test_workers_are_spawned_with_their_env(monkeypatch):
    monkeypatch.setattr(pool_servings, "SPAWNED_MARK", "changed in the test process")
    envs = [{"POOL_TEST_VAR": "first"}, {"POOL_TEST_VAR": "second"}]
    with ServingPool(pool_servings.probe, workers=2, worker_env=envs) as pool:
        pids = [h.pid for h in pool.health()]
        with ThreadPoolExecutor(4) as executor:
            seen = list(executor.map(pool.run, range(16)))
    assert "POOL_TEST_VAR" not in os.environ
    assert {r["pid"]: r["env"] for r in seen} == {pids[0]: "first", pids[1]: "second"}
    assert {r["mark"] for r in seen} == {"set only in the test process"}  # spawn, not fork


def test_routing_follows_weights_under_load():
    factory = functools.partial(pool_servings.sleeper)
    with ServingPool(factory, workers=2, weights=[1, 3], batch_size=8, batch_timeout=0.05) as pool:
        pids = [h.pid for h in pool.health()]
        barrier = threading.Barrier(8)

        def call(i):
            barrier.wait(120)
            return pool.run((0.8, i, None))["pid"]

        with ThreadPoolExecutor(8) as executor:
            chosen = list(executor.map(call, range(8)))
    assert chosen.count(pids[0]) == 2 and chosen.count(pids[1]) == 6


def test_routing_prefers_the_idle_worker(sleeper_pool):
    busy = ThreadPoolExecutor(1)
    future = busy.submit(sleeper_pool.run, (1.5, "long", None))
    wait_until(lambda: sum(h.in_flight for h in sleeper_pool.health()) == 1)
    long_pid = next(h.pid for h in sleeper_pool.health() if h.in_flight == 1)
    short = [sleeper_pool.run((0.0, i, None))["pid"] for i in range(4)]
    assert long_pid not in short
    assert future.result(120)["pid"] == long_pid
    busy.shutdown()


def test_killed_worker_fails_its_requests_then_is_replaced(sleeper_pool):
    outcome: dict = {}

    def call():
        try:
            sleeper_pool.run((30.0, "doomed", None))
        except WorkerCrashed as exc:
            outcome["error"], outcome["at"] = exc, time.monotonic()

    thread = threading.Thread(target=call)
    thread.start()
    wait_until(lambda: any(h.in_flight for h in sleeper_pool.health()))
    victim = next(h for h in sleeper_pool.health() if h.in_flight)
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(120)
    assert not thread.is_alive()
    assert outcome["at"] - killed_at < 25.0  # failed by the kill, well before its 30 s call could end
    assert str(victim.pid) in str(outcome["error"])
    wait_until(lambda: all(h.alive for h in sleeper_pool.health()))
    replaced = sleeper_pool.health()[victim.index]
    assert replaced.restarts == 1 and replaced.pid != victim.pid
    with ThreadPoolExecutor(4) as executor:
        results = list(executor.map(sleeper_pool.run, [(0.05, i, None) for i in range(8)]))
    assert [r["tag"] for r in results] == list(range(8))
    assert replaced.pid in {r["pid"] for r in results}


def test_counts_never_go_down_when_a_worker_dies():
    """A lost worker's finished requests stay counted and the call it took with it counts failed."""
    with ServingPool("pool_servings:sleeper", workers=2, batch_size=4, batch_timeout=0.01) as pool:
        with ThreadPoolExecutor(4) as executor:
            list(executor.map(pool.run, [(0.0, i, None) for i in range(8)]))
        before = pool.pool_stats()
        assert before.total.completed == 8 and all(w.serving.completed for w in before.workers)
        doomed = threading.Thread(target=lambda: pytest.raises(WorkerCrashed, pool.run, (30.0, "doomed", None)))
        doomed.start()
        wait_until(lambda: any(h.in_flight for h in pool.health()))
        victim = next(h for h in pool.health() if h.in_flight)
        os.kill(victim.pid, signal.SIGKILL)
        doomed.join(120)
        assert not doomed.is_alive()
        wait_until(lambda: all(h.alive for h in pool.health()))
        after = pool.stats()
        assert after.completed == 8 and after.failed == 1
        pool.run((0.0, "more", None))
        assert pool.stats().completed == 9


def test_deadline_is_enforced(sleeper_pool):
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        sleeper_pool.run((6.0, "late", None), deadline=0.3)
    assert time.monotonic() - start < 6.0  # ended by the deadline, before the worker's call could finish


def test_worker_exceptions_come_back():
    with ServingPool("pool_servings:raiser", workers=1) as pool:
        with pytest.raises(ValueError, match="bad value 7") as info:
            pool.run(("value", 7))
        assert isinstance(info.value.__cause__, RemoteError)
        assert "_raise" in info.value.__cause__.remote_traceback

        with pytest.raises(InvalidInput, match="got 0") as info:  # a typed input error keeps its param
            pool.run(("invalid", 0))
        assert type(info.value) is InvalidInput and isinstance(info.value, ValueError)
        assert info.value.param == "max_new_tokens"
        assert isinstance(info.value.__cause__, RemoteError)

        with pytest.raises(RemoteError) as info:
            pool.run(("two_args", 0))  # pickles, cannot be rebuilt
        assert info.value.type_name == "pool_servings.NeedsTwoArgs"
        assert info.value.message == "first"
        assert "NeedsTwoArgs" in info.value.remote_traceback

        with pytest.raises(RemoteError) as info:
            pool.run(("lock", 0))  # cannot be pickled
        assert info.value.type_name == "pool_servings.HoldsALock"
        assert "holds a lock" in str(info.value)

        assert pool.run((None, 3)) == (None, 3)


def test_payload_errors_fail_only_that_request(double_pool):
    only_here = types.ModuleType("only_in_the_test_process")

    class Thing:
        pass

    Thing.__module__ = only_here.__name__
    Thing.__qualname__ = "Thing"
    only_here.Thing = Thing
    sys.modules[only_here.__name__] = only_here
    try:
        with pytest.raises(ValueError, match="cannot decode"):
            double_pool.run(Thing())  # the worker cannot import its class
    finally:
        del sys.modules[only_here.__name__]
    with pytest.raises(TypeError, match="cannot send"):
        double_pool.run(threading.Lock())
    np.testing.assert_array_equal(double_pool.run(np.ones((1, 2))), np.full((1, 2), 2.0))


def test_iterative_stream(counter_pool):
    assert list(counter_pool.stream(4)) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert counter_pool.run(2) == [(0, 1), (0, 2)]


def test_closing_a_stream_cancels_it_in_the_worker(counter_pool):
    before = counter_pool.stats().cancelled
    stream = counter_pool.stream(10_000)  # 200 s of steps if it were not cancelled
    assert [next(stream), next(stream)] == [(0, 1), (0, 2)]
    stream.close()
    wait_until(lambda: counter_pool.stats().cancelled == before + 1, 5)
    assert counter_pool.stats().running == 0
    assert counter_pool.health()[0].in_flight == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_calls_and_cancellation(anyio_backend, counter_pool):
    results = []

    async def call(n):
        results.append(await counter_pool.run_async(n))

    async with anyio.create_task_group() as tg:
        for n in (1, 2, 3):
            tg.start_soon(call, n)
    assert sorted(results, key=len) == [[(0, 1)], [(0, 1), (0, 2)], [(0, 1), (0, 2), (0, 3)]]

    async with await counter_pool.stream_async(3) as stream:
        items = [item async for item in stream]
    assert items == [(0, 1), (0, 2), (0, 3)]

    before = counter_pool.stats().cancelled
    with anyio.move_on_after(0.2):
        await counter_pool.run_async(10_000)
    with anyio.move_on_after(0.2):
        async with await counter_pool.stream_async(10_000) as stream:
            async for _ in stream:
                pass
    await anyio.to_thread.run_sync(
        wait_until, lambda: counter_pool.stats().cancelled == before + 2, 5
    )
    assert counter_pool.stats().running == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_context_manager(anyio_backend):
    async with ServingPool("pool_servings:double", workers=1) as pool:
        out = await pool.run_async(np.arange(3.0))
        np.testing.assert_array_equal(out, np.arange(3.0) * 2)
    with pytest.raises(ServingStopped):
        await pool.run_async(np.arange(3.0))


def test_cancelled_queued_request_never_runs(tmp_path):
    log = tmp_path / "log"

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.run_async, (0.8, "first", str(log)))
            await anyio.sleep(0.2)
            with anyio.move_on_after(0.2):
                await pool.run_async((0.0, "second", str(log)))  # queued behind "first"

    with ServingPool("pool_servings:sleeper", workers=1, batch_size=1) as pool:
        anyio.run(main)
        wait_until(lambda: pool.stats().cancelled == 1)  # the worker dropped "second" from its queue
        assert log.read_text().split() == ["first"]
        assert pool.run((0.0, "third", str(log)))["tag"] == "third"  # the queue moved on without it
        assert log.read_text().split() == ["first", "third"]


def test_close_drains_then_stops_every_worker():
    before = child_pids()
    pool = ServingPool("pool_servings:sleeper", workers=2, batch_size=1)
    pids = {h.pid for h in pool.health()}
    assert pids <= child_pids()
    with ThreadPoolExecutor(2) as executor:
        futures = [executor.submit(pool.run, (0.6, i, None)) for i in range(2)]
        wait_until(lambda: sum(h.in_flight for h in pool.health()) == 2)
        pool.close()
        assert [f.result(120)["tag"] for f in futures] == [0, 1]  # drained, not failed
    assert not pids & child_pids()
    assert child_pids() <= before
    assert all(h.state == "stopped" and not h.alive for h in pool.health())
    with pytest.raises(ServingStopped):
        pool.run((0.0, "late", None))
    pool.close()  # idempotent


@pytest.mark.parametrize(
    ("factory", "error", "match"),
    [
        ("pool_servings:broken", RuntimeError, "could not load its model"),
        ("pool_servings:no_such_factory", AttributeError, "no_such_factory"),
        ("no_such_module_here:factory", ModuleNotFoundError, "no_such_module_here"),
    ],
)
def test_failing_factory_raises_and_leaves_no_children(factory, error, match):
    before = child_pids()
    with pytest.raises(error, match=match) as info:
        ServingPool(factory, workers=2)
    assert isinstance(info.value.__cause__, RemoteError)
    assert child_pids() <= before


def test_bad_arguments_are_refused_at_once():
    with pytest.raises(ValueError, match="package.module:function"):
        ServingPool("no_colon", workers=1)
    with pytest.raises(TypeError, match="picklable"):
        ServingPool(lambda: None, workers=1)
    with pytest.raises(ValueError, match="weights"):
        ServingPool("pool_servings:double", workers=2, weights=[1.0])
    with pytest.raises(ValueError, match="worker_env"):
        ServingPool("pool_servings:double", workers=2, worker_env=[{}])
    with pytest.raises(ValueError, match="batch_timeout"):
        ServingPool("pool_servings:double", workers=1, batch_timeout=-1)
    with pytest.raises(TypeError):
        ServingPool("pool_servings:double", workers=1, batch_sise=4)
    for bad in (0, -1.0, math.inf, math.nan, True, "10"):
        with pytest.raises(ValueError, match="liveness_timeout"):
            ServingPool("pool_servings:double", workers=1, liveness_timeout=bad)
        with pytest.raises(ValueError, match="heartbeat_interval"):
            ServingPool("pool_servings:double", workers=1, heartbeat_interval=bad)
    with pytest.raises(ValueError, match="shorter than liveness_timeout"):
        ServingPool("pool_servings:double", workers=1, liveness_timeout=2.0, heartbeat_interval=2.0)


def test_heartbeats_show_in_health_while_idle():
    with ServingPool("pool_servings:double", workers=1, liveness_timeout=30.0, heartbeat_interval=0.25) as pool:
        before = pool.health()[0]
        # heartbeats every 0.25 s: the last one advances while no request is answered
        wait_until(lambda: pool.health()[0].last_heartbeat >= before.last_heartbeat + 0.3)
        after = pool.health()[0]
        assert after.last_progress == before.last_progress  # no answers: no progress
        assert after.state == "ready" and after.restarts == 0


def test_liveness_none_disables_the_check():
    """Without the check a stopped worker looks alive and ready: only deadlines protect its callers."""
    def monitors():
        return sum(t.name == "serving-pool-monitor" for t in threading.enumerate())

    others = monitors()  # the module's pools
    with ServingPool("pool_servings:double", workers=1, liveness_timeout=None) as pool:
        assert monitors() == others
        pid = pool.health()[0].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeadlineExceeded):
                pool.run(np.ones(2), deadline=1.0)
            health = pool.health()[0]
            assert (health.pid, health.state, health.alive) == (pid, "ready", True)
        finally:
            os.kill(pid, signal.SIGCONT)
        np.testing.assert_array_equal(pool.run(np.ones(2)), np.full(2, 2.0))
