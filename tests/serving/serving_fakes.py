"""Fakes for the serving tests: pure numpy / Python backends, no models."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from serving import Batch


class RecordingBackend:
    """Static backend: doubles its input; records each batch's rows, key, partition and thread."""

    def __init__(self, delay: float = 0.0, fail_on: Any = None):
        self.delay, self.fail_on = delay, fail_on
        self.batches: list[tuple[list[float], Any, int]] = []
        self.threads: set[str] = set()
        self.inits: list[tuple[str, int, str]] = []
        self.lock = threading.Lock()

    def init(self, mode: str, arg: Any, partitions: int) -> dict:
        self.inits.append((mode, partitions, threading.current_thread().name))
        return {"arg": arg}

    def handle_batch(self, batch: Batch, partition: int, state: Any) -> tuple[Any, Any]:
        data = batch.data
        with self.lock:
            self.batches.append((list(np.asarray(data).ravel()[: batch.size]), batch.batch_key, partition))
            self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in np.asarray(data).ravel()[: batch.size]:
            raise RuntimeError(f"boom on {self.fail_on}")
        return data * 2, {"partition": partition, "rows": batch.size}


def rows(*values: float) -> Batch:
    """A batch of scalar float rows."""
    return Batch.concatenate([np.array(values, dtype=np.float64)])


class GateBackend(RecordingBackend):
    """A RecordingBackend whose batches wait for ``gate`` (bounded) before finishing."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def handle_batch(self, batch: Batch, partition: int, state: Any) -> tuple[Any, Any]:
        self.started.release()
        assert self.gate.wait(10), "test never opened the gate"
        return super().handle_batch(batch, partition, state)

    def wait_started(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.started.acquire(timeout=5), "batch never started"
