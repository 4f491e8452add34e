"""serving: a batching serving runtime modeled on Nx.Serving (see docs/serving.md)."""

from ._backend import Backend, IterativeBackend
from ._batch import Batch
from ._client import AsyncStream, Stream, Transducer
from ._contract import Client
from ._errors import (
    BackendError,
    DeadlineExceeded,
    InvalidInput,
    RemoteError,
    RequestCancelled,
    RequestTooLarge,
    ServingError,
    ServingOverloaded,
    ServingStopped,
    WorkerCrashed,
    WorkerUnresponsive,
)
from ._handle import ServingHandle
from ._options import ProcessOptions
from ._pool import POOL_WORKERS_ENV, PoolStats, ProcessBackend, ServingPool, WorkerHealth, WorkerStats
from ._serving import Serving
from ._telemetry import ServingStats, TelemetryEvent

__all__ = [
    "AsyncStream",
    "Backend",
    "BackendError",
    "Batch",
    "Client",
    "DeadlineExceeded",
    "InvalidInput",
    "IterativeBackend",
    "POOL_WORKERS_ENV",
    "PoolStats",
    "ProcessBackend",
    "ProcessOptions",
    "RemoteError",
    "RequestCancelled",
    "RequestTooLarge",
    "Serving",
    "ServingError",
    "ServingHandle",
    "ServingOverloaded",
    "ServingPool",
    "ServingStats",
    "ServingStopped",
    "Stream",
    "TelemetryEvent",
    "Transducer",
    "WorkerCrashed",
    "WorkerHealth",
    "WorkerStats",
    "WorkerUnresponsive",
]
