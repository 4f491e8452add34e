"""``ProcessOptions``: how a started serving collects and runs batches."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ProcessOptions"]


@dataclass(frozen=True)
class ProcessOptions:
    """Options of ``Serving.start`` (defaults follow Nx.Serving: batch_size 1, 100 ms, 30 s).

    batch_size: most rows per executed batch (iterative backends: most rows running at once);
      None means the serving's own ``batch_size`` or 1.
    batch_timeout: seconds a batch waits after its first row arrives before running unfilled
      (iterative backends: the admission window when idle).
    batch_keys: every batch key callers may use; each has its own stack and timer.
    partitions: executor threads, each running batches (or a step loop) on its own.
    max_queue: most rows waiting; a request that would exceed it raises ``ServingOverloaded``.
    shutdown_timeout: seconds ``stop()`` lets running work finish before failing it.

    Raises ``ValueError`` naming the option for a value of the wrong type or out of range (the
    timeouts: finite numbers of seconds in [0, 1e9]), and when ``max_queue < batch_size`` (a batch
    could then never fill).
    """

    batch_size: int | None = None
    batch_timeout: float = 0.1
    batch_keys: tuple[Any, ...] = field(default=("default",))
    partitions: int = 1
    max_queue: int | None = None
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_keys", tuple(self.batch_keys))
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        _check_seconds("batch_timeout", self.batch_timeout)
        if not self.batch_keys:
            raise ValueError("batch_keys must name at least one key")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")
        if self.max_queue is not None and self.max_queue < (self.batch_size or 1):
            raise ValueError(
                f"max_queue ({self.max_queue}) must be >= batch_size ({self.batch_size or 1}): "
                "a batch could never fill"
            )
        _check_seconds("shutdown_timeout", self.shutdown_timeout)

    def merge(self, **overrides: Any) -> ProcessOptions:
        """A copy with ``overrides`` applied (unknown names raise ``TypeError``).

        Any: callers forward options given by name at run time; ``__post_init__`` checks them."""
        return replace(self, **overrides)


def _check_seconds(name: str, value: object) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite number of seconds in [0, 1e9]
    (not a bool): NaN compares false everywhere and longer waits overflow the blocking calls."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= 1e9):
        raise ValueError(f"{name} must be a finite number of seconds in [0, 1e9], got {value!r}")
