"""Process-pool deployment of a Serving (private; the public name is ``serving.ServingPool``).

Modules: ``_wire`` (messages, framing, payload codec), ``_worker`` (the worker process),
``_remote`` (exceptions across the boundary), ``_stderr`` (relaying a worker's stderr),
``_stats`` (health and stats records), ``_pool`` (``ServingPool``: spawning, routing, the client
contract, failure handling).
"""

from ._pool import ServingPool
from ._stats import PoolStats, WorkerHealth, WorkerStats

__all__ = ["PoolStats", "ServingPool", "WorkerHealth", "WorkerStats"]
