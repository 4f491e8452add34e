"""Process-pool deployment of a Serving (private; the public name is ``serving.ServingPool``).

Modules: ``_wire`` (messages, framing, payload codec), ``_worker`` (the worker process),
``_pool`` (``ServingPool``: spawning, routing, failure handling).
"""

from ._pool import PoolStats, ServingPool, WorkerHealth, WorkerStats

__all__ = ["PoolStats", "ServingPool", "WorkerHealth", "WorkerStats"]
