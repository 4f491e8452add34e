"""A Ray pool across nodes (``ray.cluster_utils.Cluster``: a head and worker nodes that carry a
custom ``{"mlx": 1}`` resource, all on this machine): the actor is placed by the resource; losing
its node fails the requests it held with WorkerCrashed, Ray restarts the actor on another node
with the resource, and later requests succeed there.

Its own cluster (not the ``ray_cluster`` of the other modules), shut down at the end."""

from __future__ import annotations

import threading

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from mlx_serving.serving import ServingPool, WorkerCrashed  # noqa: E402
from ray_helpers import wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a cap that only ends a hang

MLX = {"resources": {"mlx": 1}, "num_cpus": 0}  # one actor per node that has the resource
NODE = {"num_cpus": 1, "resources": {"mlx": 1}}


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        pytest.skip("needs its own Ray cluster, and this process is connected to another one")
    # no node_ip_address: ray.init resolves a loopback cluster address to this machine's IP
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_placement_by_resource_and_node_loss(cluster):
    first = cluster.add_node(**NODE)
    with ServingPool("ray_servings:node_probe", backend="ray", ray_actor_options=MLX, start_timeout=60) as pool:
        assert pool.run(0.0)["node"] == first.node_id  # the only node with {"mlx": 1}
        second = cluster.add_node(**NODE)
        outcomes: list[object] = []

        def run() -> None:
            try:
                outcomes.append(pool.run(30.0))
            except WorkerCrashed as exc:
                outcomes.append(exc)

        def stream() -> None:
            try:
                outcomes.append(list(pool.stream(30.0)))
            except WorkerCrashed as exc:
                outcomes.append(exc)

        callers = [threading.Thread(target=run), threading.Thread(target=run), threading.Thread(target=stream)]
        for caller in callers:
            caller.start()
        wait_until(lambda: pool.health()[0].in_flight == 3)
        pid = pool.health()[0].pid
        cluster.remove_node(first)
        for caller in callers:
            caller.join(120)
        assert not any(caller.is_alive() for caller in callers)
        assert len(outcomes) == 3 and all(isinstance(o, WorkerCrashed) and o.request_id for o in outcomes)

        wait_until(lambda: pool.health()[0].state == "ready")  # Ray restarted it on `second`
        health = pool.health()[0]
        assert health.restarts == 1 and health.pid != pid
        answer = pool.run(0.0)
        assert answer["node"] == second.node_id and answer["pid"] == health.pid
        [name] = pool.backend.actor_names
    wait_until(lambda: name not in ray.util.list_named_actors())
