"""ServingPool over a RayBackend (also ``backend="ray"``): the client contract over real Ray actors on a
local cluster."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from mlx_serving.serving import (  # noqa: E402
    BackendError,
    Client,
    DeadlineExceeded,
    InvalidInput,
    ServingPool,
    ServingStopped,
    WorkerCrashed,
)
from mlx_serving.serving.ray import RayBackend  # noqa: E402
from ray_helpers import wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a cap that only ends a hang

LIGHT = {"num_cpus": 0}  # several small pools share the 2-CPU test cluster


def named_actors() -> set[str]:
    return set(ray.util.list_named_actors())


@pytest.fixture(scope="module")
def double_pool(ray_cluster):
    with ServingPool("pool_servings:double", workers=2, backend="ray", ray_actor_options=LIGHT,
                     batch_size=8, batch_timeout=0.01) as pool:
        yield pool


@pytest.fixture(scope="module")
def sleeper_pool(ray_cluster):
    with ServingPool("pool_servings:sleeper", workers=2, backend="ray", ray_actor_options=LIGHT,
                     batch_size=4, batch_timeout=0.05) as pool:
        yield pool


@pytest.fixture(scope="module")
def counter_pool(ray_cluster):
    with ServingPool("pool_servings:counter", workers=1, backend="ray", ray_actor_options=LIGHT,
                     batch_size=4, batch_timeout=0.01) as pool:
        yield pool


def test_results_from_many_threads(double_pool):
    assert isinstance(double_pool.backend, RayBackend) and isinstance(double_pool, Client)
    inputs = [np.full((i % 3 + 1, 3), i, dtype=np.float32) for i in range(24)]
    with ThreadPoolExecutor(12) as executor:
        outputs = list(executor.map(double_pool.run, inputs))
    for x, y in zip(inputs, outputs):
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, x * 2)
    health = double_pool.health()
    assert [h.state for h in health] == ["ready", "ready"] and all(h.in_flight == 0 for h in health)
    assert len({h.pid for h in health}) == 2 and os.getpid() not in {h.pid for h in health}


def test_static_stream_yields_batch_pieces(double_pool):
    x = np.arange(60, dtype=np.int64).reshape(20, 3)
    pieces = list(double_pool.stream(x))
    assert len(pieces) == 3  # batch_size 8: 8 + 8 + 4 rows
    np.testing.assert_array_equal(np.concatenate([output for output, _ in pieces]), x * 2)


def test_batching_inside_the_actors_and_routing_by_outstanding(sleeper_pool):
    before = sleeper_pool.pool_stats()
    with ThreadPoolExecutor(8) as executor:
        results = list(executor.map(sleeper_pool.run, [(0.3, i, None) for i in range(8)]))
    assert [r["tag"] for r in results] == list(range(8))
    assert len({r["pid"] for r in results}) == 2  # least outstanding: both actors got requests
    after = sleeper_pool.pool_stats()
    batches = after.total.batches_run - before.total.batches_run
    assert after.total.completed - before.total.completed == 8
    assert batches < 8  # requests routed to one actor batched together in its serving
    assert all(w.serving is not None and w.pid is not None for w in after.workers)


def test_stream_and_async(counter_pool):
    with counter_pool.stream(5) as stream:
        assert list(stream) == [(0, n) for n in range(1, 6)]

    async def main():
        result = await counter_pool.run_async(3)
        async with await counter_pool.stream_async(4) as stream:
            items = [item async for item in stream]
        return result, items

    result, items = anyio.run(main)
    assert result == [(0, 1), (0, 2), (0, 3)]
    assert items == [(0, n) for n in range(1, 5)]


def test_cancellation_reaches_the_actor(counter_pool):
    before = counter_pool.stats()
    with counter_pool.stream(10_000) as stream:
        assert next(stream) == (0, 1)
    assert counter_pool.health()[0].in_flight == 0  # forgotten at once in the caller
    wait_until(lambda: counter_pool.stats().cancelled == before.cancelled + 1)
    assert counter_pool.stats().running == 0  # the row left the actor's serving

    async def cancelled_task():
        with anyio.move_on_after(0.2):
            await counter_pool.run_async(10_000)

    anyio.run(cancelled_task)
    wait_until(lambda: counter_pool.stats().cancelled == before.cancelled + 2)
    wait_until(lambda: counter_pool.stats().running == 0)


def test_deadline_is_enforced_by_the_caller(sleeper_pool):
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as caught:
        sleeper_pool.run((6.0, "late", None), deadline=0.3)
    assert time.monotonic() - start < 6.0  # ended by the deadline, before the actor's call could finish
    assert caught.value.request_id is not None
    assert sum(h.in_flight for h in sleeper_pool.health()) == 0


def test_errors_come_back_as_their_types(ray_cluster):
    with ServingPool("pool_servings:raiser", backend="ray", ray_actor_options=LIGHT) as pool:
        with pytest.raises(ValueError, match="bad value 3"):
            pool.run(("value", 3))
        with pytest.raises(InvalidInput) as invalid:  # a typed input error keeps its param
            pool.run(("invalid", 0))
        assert invalid.value.param == "max_new_tokens" and isinstance(invalid.value, ValueError)
        assert pool.run((None, 1)) == (None, 1)
    with ServingPool("pool_servings:failing", backend="ray", ray_actor_options=LIGHT) as pool:
        with pytest.raises(BackendError) as caught:
            pool.run(-1)
        assert caught.value.request_id is not None
        assert pool.run(4) == 4


def test_actor_killed_mid_stream_then_restarted(ray_cluster):
    with ServingPool("pool_servings:counter", backend="ray", ray_actor_options=LIGHT, batch_size=4,
                     batch_timeout=0.01) as pool:
        pid = pool.health()[0].pid
        stream = pool.stream(10_000)
        assert next(stream) == (0, 1)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerCrashed) as caught:
            for _ in stream:
                pass
        assert time.monotonic() - start < 100  # failed by the kill, not after the stream's 200 s of steps
        assert caught.value.request_id == stream.request_id
        wait_until(lambda: pool.health()[0].state == "ready")
        health = pool.health()[0]
        assert health.restarts == 1 and health.pid != pid
        assert pool.run(2) == [(0, 1), (0, 2)]  # the restarted actor serves


def test_close_answers_every_caller_and_leaves_no_actor(ray_cluster):
    pool = ServingPool("pool_servings:sleeper", workers=2, backend="ray", ray_actor_options=LIGHT,
                       batch_size=1, batch_timeout=0.01)
    names = set(pool.backend.actor_names)
    assert names <= named_actors()
    outcomes: list[object] = []

    def call(i: int) -> None:
        try:
            outcomes.append(pool.run((0.6, i, None)))
        except ServingStopped as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    wait_until(lambda: sum(h.in_flight for h in pool.health()) == 6)
    time.sleep(0.2)
    pool.close(timeout=0.3)
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert len(outcomes) == 6  # every caller answered: a result or ServingStopped
    assert any(isinstance(o, ServingStopped) for o in outcomes)
    assert all(isinstance(o, dict) or o.request_id is not None for o in outcomes)
    with pytest.raises(ServingStopped):
        pool.run((0.0, "after", None))
    pool.close()  # idempotent
    wait_until(lambda: not names & named_actors())
    assert {h.state for h in pool.health()} == {"stopped"}


def test_a_failing_factory_fails_the_constructor(ray_cluster):
    before = named_actors()
    with pytest.raises(RuntimeError, match="could not load its model"):
        ServingPool("pool_servings:broken", workers=2, backend="ray", ray_actor_options=LIGHT)
    wait_until(lambda: named_actors() <= before)


def test_bad_arguments(ray_cluster):
    with pytest.raises(TypeError, match="liveness_timeout"):
        ServingPool("pool_servings:double", backend="ray", liveness_timeout=3.0)
    with pytest.raises(ValueError, match="backend"):
        ServingPool("pool_servings:double", backend="dask")
    with pytest.raises(TypeError, match="ray_actor_options"):
        ServingPool("pool_servings:double", ray_actor_options={"num_cpus": 1})
    with pytest.raises(TypeError):
        ServingPool("pool_servings:double", backend="ray", batch_sise=3)


def test_a_pool_shuts_down_only_the_ray_it_started(ray_cluster):
    """Without ray.init, the pools start one connection (a local cluster of their own), shared,
    shut down with the last pool; a connection the caller made stays up. A fresh interpreter, so
    the module's cluster is not seen by the pools' ray.init(); the caller's own connection joins
    it (ray.init(address=...), as a caller joins a running cluster) rather than start a second
    local cluster."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    pool_tests = str(Path(__file__).resolve().parent.parent / "pool")
    address = ray_cluster.get_runtime_context().gcs_address
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {pool_tests!r})
        import ray
        from mlx_serving.serving import ServingPool
        light = {{"num_cpus": 0}}
        a = ServingPool("pool_servings:probe", backend="ray", ray_actor_options=light)
        b = ServingPool("pool_servings:probe", backend="ray", ray_actor_options=light)
        a.close()
        assert ray.is_initialized() and b.run(1)["rows"] == 1
        b.close()
        assert not ray.is_initialized()
        ray.init(address={address!r}, _node_ip_address="127.0.0.1")
        with ServingPool("pool_servings:probe", backend="ray", ray_actor_options=light) as c:
            assert c.run(2)["rows"] == 1
        assert ray.is_initialized()
        ray.shutdown()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=540, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")
