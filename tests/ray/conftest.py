"""A local Ray cluster for the Ray backend tests (skipped without ray): started by the first test
that asks for ``ray_cluster``, kept for the next modules that ask for it too (test_ray_pool.py,
then test_ray_serve.py: one start and one shutdown, not one per module) and shut down as soon as
the next test belongs to a module that does not use it (or none is left), so that it stays up
neither for the rest of the suite nor into a module that needs its own cluster
(test_ray_multinode.py skips when this process is connected)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

POOL_TESTS = str(Path(__file__).resolve().parent.parent / "pool")
if POOL_TESTS not in sys.path:  # pool_servings: the servings the process-pool tests use
    sys.path.insert(0, POOL_TESTS)

_started: list[object] = []  # the ray module, when ray_cluster started the connection


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        # address="local": always a cluster of its own, never one found on the machine (another test
        # process's, or one that a killed run left behind in /tmp/ray/ray_current_cluster)
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
        _started.append(ray)
    return ray


def _uses_the_cluster(item: pytest.Item | None) -> bool:
    """Whether any test of ``item``'s module asks (directly or through a fixture) for ray_cluster."""
    module = getattr(item, "module", None)
    if item is None or module is None:
        return False
    return any(getattr(other, "module", None) is module and "ray_cluster" in getattr(other, "fixturenames", ())
               for other in item.session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        return (yield)  # the module's fixtures (Serve, pools) are torn down first
    finally:
        if _started and (nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None)) \
                and not _uses_the_cluster(nextitem):
            _started.pop().shutdown()
