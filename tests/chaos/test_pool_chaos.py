"""A ServingPool under real failures of its worker processes: a worker stopped (SIGSTOP) or
deadlocked in native code while holding the GIL is declared unresponsive after
``liveness_timeout`` (its callers get WorkerUnresponsive, it is killed, reaped and replaced); a
killed worker (SIGKILL) fails its callers with WorkerCrashed at once; a busy backend is left
alone; close() after all that leaves no thread, fd or child process (no resource tracker either).

One pool serves the whole module (tests run in file order; each one leaves both workers ready).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import types
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pool"))  # pool_servings, for the workers too

from mlx_serving.serving import ServingPool, WorkerCrashed, WorkerUnresponsive  # noqa: E402
from portable import child_pids, open_fds  # noqa: E402

LIVENESS = 1.5  # liveness_timeout of the pool under test (heartbeats every 0.375 s)
MARGIN = 1.0  # scheduling slack on a shared machine
LINUX = sys.platform.startswith("linux")

pytestmark = [
    pytest.mark.skipif(not LINUX, reason="reads /proc; the native deadlock needs glibc"),
    pytest.mark.timeout(60),
]


def pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("serving-pool")}


def wait_until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


class Outcome:
    """Runs ``call`` on a thread; records what it returned or raised, and when."""

    def __init__(self, call) -> None:
        self.value = self.error = self.at = None
        self._thread = threading.Thread(target=self._run, args=(call,))
        self._thread.start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except Exception as exc:
            self.error = exc
        self.at = time.monotonic()

    def wait(self, timeout: float) -> Outcome:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the caller is still blocked"
        return self


@pytest.fixture(scope="module")
def chaos():
    gc.collect()
    before = types.SimpleNamespace(
        fds=open_fds(),
        threads=pool_threads(),
        children=child_pids(),
        tracker=resource_tracker._resource_tracker._pid,
    )
    pool = ServingPool("pool_servings:hazard", workers=2, batch_size=4, batch_timeout=0.0, liveness_timeout=LIVENESS)
    yield types.SimpleNamespace(pool=pool, before=before)
    pool.close()


def busy_worker(pool: ServingPool):
    wait_until(lambda: sum(h.in_flight for h in pool.health()) == 1, 5)
    return next(h for h in pool.health() if h.in_flight)


def check_replaced(pool: ServingPool, victim, restarts: int, error: BaseException, elapsed: float,
                   hung: bool) -> None:
    """What follows a failed worker: the right error in time, routing around it, its process
    reaped, a replacement that serves."""
    if hung:
        assert isinstance(error, WorkerUnresponsive), repr(error)
        assert LIVENESS - 0.5 < elapsed < LIVENESS + 0.5 + MARGIN, elapsed  # + up to 0.5 s of stack dump
        assert "liveness_timeout 1.5 s" in str(error)
    else:
        assert type(error) is WorkerCrashed, repr(error)
        assert elapsed < MARGIN, elapsed
    assert str(victim.pid) in str(error) and error.request_id is not None
    now = pool.health()[victim.index]
    assert now.in_flight == 0 and not (now.alive and now.pid == victim.pid)
    if now.pid == victim.pid:  # the replacement is not ready yet
        assert now.state == ("unresponsive" if hung else "restarting"), now
    other = pool.health()[1 - victim.index]
    assert {pid for _, pid in pool.run(3)} == {other.pid}  # served at once, by the other worker
    wait_until(lambda: victim.pid not in child_pids(), 5)  # killed and reaped
    assert not Path(f"/proc/{victim.pid}").exists()
    wait_until(lambda: pool.health()[victim.index].alive)
    replacement = pool.health()[victim.index]
    assert replacement.state == "ready" and replacement.pid != victim.pid
    assert replacement.restarts == restarts + 1
    streams = [pool.stream(10) for _ in range(4)]  # in flight together: two per worker
    served = {pid for stream in streams for _, pid in stream}
    assert served == {replacement.pid, other.pid}


@pytest.mark.parametrize("kind", ["request", "stream"])
def test_a_stopped_worker_is_declared_unresponsive(chaos, kind):
    pool = chaos.pool
    if kind == "request":
        outcome = Outcome(lambda: pool.run(10_000))  # 200 s of steps
    else:
        stream = pool.stream(10_000)
        assert next(stream)[1] == next(stream)[1]  # the worker's pid
        outcome = Outcome(lambda: list(stream))
    victim = busy_worker(pool)
    restarts = victim.restarts
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    outcome.wait(LIVENESS + 2 * MARGIN)
    if kind == "stream":
        assert outcome.error.request_id == stream.request_id
    check_replaced(pool, victim, restarts, outcome.error, outcome.at - stopped_at, hung=True)


@pytest.mark.parametrize("kind", ["request", "stream"])
def test_a_killed_worker_fails_its_callers_at_once(chaos, kind):
    pool = chaos.pool
    if kind == "request":
        outcome = Outcome(lambda: pool.run(10_000))
    else:
        stream = pool.stream(10_000)
        next(stream)
        outcome = Outcome(lambda: list(stream))
    victim = busy_worker(pool)
    restarts = victim.restarts
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    outcome.wait(2 * MARGIN)
    if kind == "stream":
        assert outcome.error.request_id == stream.request_id
    check_replaced(pool, victim, restarts, outcome.error, outcome.at - killed_at, hung=False)


@pytest.mark.parametrize(("row", "where"), [(-1, "_native_deadlock"), (-2, "in step")])
def test_a_backend_holding_the_gil_for_ever_is_declared_unresponsive(chaos, row, where):
    """-1: a native deadlock with the GIL held; -2: a regular expression that never ends. Either
    way the worker's loop cannot run, so it stops beating. Its stacks (SIGUSR1, faulthandler) end
    the error message."""
    pool = chaos.pool
    outcome = Outcome(lambda: pool.run(row))
    victim = busy_worker(pool)
    started = time.monotonic()
    outcome.wait(LIVENESS + 2 * MARGIN + 0.5)
    assert where in str(outcome.error), str(outcome.error)
    check_replaced(pool, victim, victim.restarts, outcome.error, outcome.at - started, hung=True)


def test_a_busy_backend_is_not_unresponsive(chaos):
    """A backend spinning in Python for 2 x liveness_timeout on its executor thread: the GIL is
    switched, the worker's loop keeps beating, and the request completes."""
    pool = chaos.pool
    before = pool.health()
    start = time.monotonic()
    [(_, pid)] = pool.run(-3)
    assert time.monotonic() - start >= 3.0
    after = pool.health()
    assert pid in {h.pid for h in before}
    assert [(h.pid, h.restarts, h.state) for h in after] == [(h.pid, h.restarts, "ready") for h in before]


def test_close_with_a_stopped_worker_is_quick_and_leaves_nothing(chaos):
    """close() does not wait shutdown_timeout (30 s) for a stopped worker: the monitor declares it
    unresponsive and kills it. Then no thread, fd or child process is left, and no resource
    tracker was started."""
    pool = chaos.pool
    hung = Outcome(lambda: pool.run(10_000))
    victim = busy_worker(pool)
    finishing = Outcome(lambda: pool.run(20))  # 0.4 s on the other worker: drained by close()
    wait_until(lambda: sum(h.in_flight for h in pool.health()) == 2, 5)
    os.kill(victim.pid, signal.SIGSTOP)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < LIVENESS + 2 * MARGIN
    assert isinstance(hung.wait(1).error, WorkerUnresponsive)
    assert len(finishing.wait(1).value) == 20
    assert all(h.state == "stopped" and not h.alive for h in pool.health())
    gc.collect()
    assert pool_threads() <= chaos.before.threads
    assert open_fds() <= chaos.before.fds
    assert child_pids() <= chaos.before.children
    assert resource_tracker._resource_tracker._pid == chaos.before.tracker  # none started by the pool
