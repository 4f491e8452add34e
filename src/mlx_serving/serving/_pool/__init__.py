"""Deployment of a Serving over N workers (private; the public names are ``serving.ServingPool``
and ``serving.ProcessBackend``).

Modules: ``_pool`` (``ServingPool``: slots, routing, the submit loop, restarts, health, stats,
close), ``_base`` (the client contract's verbs and the helpers the pool and its backends share),
``_backend`` (the pool <-> backend seam: ``PoolBackend``, ``PoolWorker``, ``PoolEvents``),
``_process`` (``ProcessBackend``: spawned worker processes, liveness), ``_connection`` (one worker
process's connection), ``_wire`` (messages, framing, payload codec), ``_worker`` (the worker
process), ``_remote`` (exceptions across the boundary), ``_stderr`` (relaying a worker's stderr),
``_stats`` (health and stats records). The Ray backend is ``serving.ray.RayBackend``.
"""

from ._pool import ServingPool
from ._process import POOL_WORKERS_ENV, ProcessBackend
from ._stats import PoolStats, WorkerHealth, WorkerStats

__all__ = ["POOL_WORKERS_ENV", "PoolStats", "ProcessBackend", "ServingPool", "WorkerHealth", "WorkerStats"]
