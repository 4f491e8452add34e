"""A local Ray cluster for the Ray backend tests (one per test module, so that none stays up for
the rest of the suite; skipped without ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

POOL_TESTS = str(Path(__file__).resolve().parent.parent / "pool")
if POOL_TESTS not in sys.path:  # pool_servings: the servings the process-pool tests use
    sys.path.insert(0, POOL_TESTS)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()
