"""The client contract over a ServingPool: what tests/serving/test_contract.py checks for the
inline serving and a handle, with each request running in a worker process; and what a worker's
stderr adds to a failure at start."""

from __future__ import annotations

import functools
import gc
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import anyio
import pytest

from mlx_serving.serving import (
    AsyncStream,
    BackendError,
    Client,
    DeadlineExceeded,
    PoolStats,
    Serving,
    ServingPool,
    ServingStats,
    ServingStopped,
    Stream,
    WorkerCrashed,
)
from portable import child_pids, open_fds


pytestmark = pytest.mark.timeout(600)  # a cap that only ends a hang (pyproject's 120 s is tight on a busy machine)


def wait_for(predicate, timeout: float = 120.0) -> None:
    """Poll until ``predicate()``; the cap only ends a hang (shared, busy machines are slow)."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition never became true"
        time.sleep(0.01)


def pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("serving-pool")}


@pytest.fixture(scope="module")
def pool():
    """One worker of the iterative counter serving: ``n`` streams (0, 1) ... (0, n), 20 ms apart."""
    with ServingPool("pool_servings:counter", workers=1, batch_size=4, batch_timeout=0.0) as pool:
        yield pool


def test_the_pool_is_a_client_and_answers_alike(pool):
    assert isinstance(pool, Client)
    assert pool.run(3) == [(0, 1), (0, 2), (0, 3)]
    with pool.stream(2) as stream:
        assert isinstance(stream, Stream)
        assert list(stream) == [(0, 1), (0, 2)]
    stats = pool.stats()
    assert isinstance(stats, ServingStats)
    assert (stats.queued, stats.running) == (0, 0) and stats.completed >= 2
    detail = pool.pool_stats()
    assert isinstance(detail, PoolStats) and detail.workers[0].serving.completed == detail.total.completed


def test_a_stream_is_sent_when_made(pool):
    before = pool.stats().cancelled
    stream = pool.stream(10_000)
    try:
        wait_for(lambda: pool.stats().running == 1)  # nobody called next() yet
    finally:
        stream.close()
    wait_for(lambda: pool.stats().running == 0)
    assert pool.stats().cancelled == before + 1
    assert pool.health()[0].in_flight == 0


def test_leaving_a_with_block_withdraws(pool):
    before = pool.stats().cancelled
    with pool.stream(10_000) as stream:
        assert next(stream) == (0, 1)
    assert pool.health()[0].in_flight == 0  # forgotten at once; the worker is told to cancel
    wait_for(lambda: pool.stats().cancelled == before + 1)
    assert pool.stats().running == 0


def test_a_dropped_stream_warns_and_is_withdrawn(pool):
    before = pool.stats().cancelled
    stream = pool.stream(10_000)
    wait_for(lambda: pool.stats().running == 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del stream
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    wait_for(lambda: pool.stats().running == 0)
    assert pool.stats().cancelled == before + 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_verbs(pool, backend):
    before = pool.stats().cancelled

    async def main():
        assert await pool.run_async(2) == [(0, 1), (0, 2)]
        stream = await pool.stream_async(2)
        assert isinstance(stream, AsyncStream)
        async with stream:
            assert [item async for item in stream] == [(0, 1), (0, 2)]
        refused = await pool.stream_async(10_000)
        with pytest.raises(TypeError, match="async for"):
            for _ in refused:  # noqa: B007
                pass
        await refused.aclose()
        long = await pool.stream_async(10_000)  # sent when the await returns
        await anyio.to_thread.run_sync(wait_for, lambda: pool.stats().running == 1)
        await long.aclose()
        long = await pool.stream_async(10_000)
        with anyio.move_on_after(0.1):  # the reading task is cancelled: the request is withdrawn
            async for _ in long:
                pass
        with anyio.move_on_after(0.1):
            await pool.run_async(10_000)
        await anyio.to_thread.run_sync(wait_for, lambda: pool.stats().running == 0)

    anyio.run(main, backend=backend)
    wait_for(lambda: pool.stats().cancelled == before + 4)


def test_deadline_errors_carry_the_request_id(pool):
    stream = pool.stream(10_000, deadline=0.1)
    with pytest.raises(DeadlineExceeded) as info:
        list(stream)
    assert info.value.request_id == stream.request_id


def test_worker_errors_carry_the_callers_request_id():
    with ServingPool("pool_servings:failing", workers=1) as failing:
        stream = failing.stream(-1)
        with pytest.raises(BackendError) as info:
            list(stream)
        assert info.value.request_id == stream.request_id
        assert "negative input" in str(info.value.__cause__)
        with pytest.raises(TypeError, match="cannot stop rows"):
            failing.stream(1)._request.owner.stop_rows(None, [0])
    with pytest.raises(ServingStopped) as info:
        failing.run(1)
    assert info.value.request_id is not None


def test_the_deadline_holds_when_the_worker_hangs():
    with ServingPool("pool_servings:counter", workers=1) as hung:
        pid = hung.health()[0].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded) as info:
                hung.run(1, deadline=0.5)
            elapsed = time.monotonic() - start
            assert info.value.request_id is not None
            assert hung.health()[0].in_flight == 0  # withdrawn by the caller (Cancel sent)
            with hung.stream(1, deadline=0.2) as stream, pytest.raises(DeadlineExceeded):
                next(stream)
            with pytest.raises(DeadlineExceeded):
                anyio.run(functools.partial(hung.run_async, 1, deadline=0.2))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert 0.45 <= elapsed < 5.0  # the deadline ended it, well before liveness_timeout (10 s) would
        assert hung.run(2) == [(0, 1), (0, 2)]  # the worker drops the withdrawn calls, carries on


def test_static_entry_points_dispatch_to_the_pool(pool):
    assert Serving.batched_run(pool, 2) == [(0, 1), (0, 2)]
    with Serving.stream(pool, 1) as stream:
        assert list(stream) == [(0, 1)]
    assert anyio.run(Serving.batched_run_async, pool, 1) == [(0, 1)]


def test_a_worker_dying_at_start_reports_its_stderr():
    threads = pool_threads()
    with pytest.raises(WorkerCrashed, match="exited with code 3 while starting") as info:
        ServingPool("pool_servings:dies_at_start", workers=1)
    assert "fatal: the model file is corrupt" in str(info.value)
    assert "hint" not in str(info.value)
    assert pool_threads() <= threads


def test_a_script_without_a_main_guard_gets_the_childs_traceback(tmp_path: Path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent("""
        from mlx_serving.serving import Serving, ServingPool, WorkerCrashed

        def make():
            return Serving.new(lambda batch: batch.data)

        try:
            pool = ServingPool(make, workers=1, start_timeout=60)
        except WorkerCrashed as exc:
            print("CAUGHT", exc)
        else:
            pool.close()
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "CAUGHT pool worker 0" in done.stdout and "exited with code 1 while starting" in done.stdout
    assert "Traceback" in done.stdout and "bootstrapping phase" in done.stdout  # the child's
    assert 'hint: ' in done.stdout and 'if __name__ == "__main__":' in done.stdout
    assert "bootstrapping phase" in done.stderr  # also relayed as the child wrote it


def test_close_leaves_no_thread_fd_or_process():
    gc.collect()
    fds, threads, children = open_fds(), pool_threads(), child_pids()
    tracker = multiprocessing.resource_tracker._resource_tracker._pid
    with ServingPool("pool_servings:counter", workers=2) as short:
        assert {t.name for t in pool_threads() - threads} >= {"serving-pool-monitor"}
        assert short.run(1) == [(0, 1)]
        victim = short.health()[0].pid
        os.kill(victim, signal.SIGKILL)  # a replaced worker is released too
        wait_for(lambda: short.health()[0].restarts == 1 and short.health()[0].alive)
        assert [short.run(1) for _ in range(4)] == [[(0, 1)]] * 4
    gc.collect()
    assert pool_threads() <= threads
    assert open_fds() <= fds
    assert child_pids() <= children
    assert multiprocessing.resource_tracker._resource_tracker._pid == tracker


def test_no_resource_tracker_is_started(tmp_path: Path):
    """A stock spawn start launches multiprocessing's resource tracker, a child of the caller that
    outlives close(); the pool's workers start without one. Checked in a fresh interpreter, where
    nothing else could have started it: after close() the caller has no child process at all."""
    script = tmp_path / "tracker.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from multiprocessing import resource_tracker
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from mlx_serving.serving import ServingPool

        def children():
            pids = set()
            for task in Path(f"/proc/{{os.getpid()}}/task").iterdir():
                try:
                    pids.update(int(pid) for pid in (task / "children").read_text().split())
                except FileNotFoundError:  # a thread that ended since the listing
                    pass
            return pids

        if __name__ == "__main__":
            with ServingPool("pool_servings:counter", workers=2, liveness_timeout=1.0) as pool:
                pids = {{h.pid for h in pool.health()}}
                assert children() == pids, (children(), pids)  # the workers and nothing else
                os.kill(pool.health()[0].pid, signal.SIGSTOP)  # unresponsive: killed, replaced
                while not (pool.health()[0].restarts == 1 and pool.health()[0].alive):
                    time.sleep(0.02)
                assert pool.run(2) == [(0, 1), (0, 2)]
            print("TRACKER", resource_tracker._resource_tracker._pid, "CHILDREN", sorted(children()))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr
    assert "TRACKER None CHILDREN []" in done.stdout
