"""ServingDeployment: a started Serving per Ray Serve replica (real Serve on the local cluster)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from mlx_serving.serving import DeadlineExceeded  # noqa: E402
from mlx_serving.serving.ray import ServingDeployment, serving_app  # noqa: E402

pytestmark = pytest.mark.timeout(120)

POOL_TESTS = str(Path(__file__).resolve().parent.parent / "pool")
# replicas import pool_servings through the runtime_env, as a cluster deployment ships its code
LIGHT = {"num_cpus": 0, "runtime_env": {"env_vars": {"PYTHONPATH": POOL_TESTS}}}


def wait_until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def serve_instance(ray_cluster):
    serve.start(proxy_location="Disabled")  # handles only: no HTTP port taken on a shared machine
    try:
        yield serve
    finally:
        serve.shutdown()


def test_run_stream_stats_and_batching(serve_instance):
    app = serving_app("pool_servings:sleeper", process_options={"batch_size": 4, "batch_timeout": 0.05},
                      ray_actor_options=LIGHT, name="sleeper")
    handle = serve.run(app, name="sleeper", route_prefix=None)
    responses = [handle.run.remote((0.2, i, None)) for i in range(8)]
    assert [r.result(timeout_s=60)["tag"] for r in responses] == list(range(8))
    stats = handle.stats.remote().result()
    assert stats.completed == 8 and stats.batches_run < 8  # batched inside the replica's serving
    with pytest.raises(DeadlineExceeded):
        handle.run.remote((1.0, "late", None), deadline=0.2).result(timeout_s=30)
    serve.delete("sleeper")

    counter = serve.run(ServingDeployment.options(ray_actor_options=LIGHT, name="counter").bind(
        "pool_servings:counter", {"batch_size": 4, "batch_timeout": 0.01}), name="counter", route_prefix=None)
    items = list(counter.options(stream=True).stream.remote(4))
    assert items == [(0, n) for n in range(1, 5)]
    # cancelling a streaming response withdraws the row from the replica's serving
    response = counter.options(stream=True).stream.remote(10_000)
    assert next(iter(response)) == (0, 1)
    response.cancel()
    wait_until(lambda: counter.stats.remote().result().cancelled == 1)
    wait_until(lambda: counter.stats.remote().result().running == 0)
    serve.delete("counter")


def test_check_health_fails_when_the_serving_is_stuck(ray_cluster):
    replica = ServingDeployment.func_or_class("pool_servings:sleeper", {"batch_size": 1, "batch_timeout": 0.0},
                                              stuck_after=0.3)
    try:
        replica.check_health()
        thread = threading.Thread(target=replica._handle.run, args=((1.5, "stuck", None),))
        thread.start()
        time.sleep(0.1)
        replica.check_health()  # progress noted
        time.sleep(0.5)
        with pytest.raises(RuntimeError, match="stuck"):
            replica.check_health()
        thread.join()
        replica.check_health()  # it finished: healthy again
        assert isinstance(replica._handle.run((0.0, "x", None)), dict)
    finally:
        replica._handle.close()


def test_overload_maps_to_max_ongoing_requests():
    app = serving_app("pool_servings:double", process_options={"batch_size": 2, "max_queue": 6})
    assert app._bound_deployment.max_ongoing_requests == 6
