"""Fakes for the serving tests: pure numpy / Python backends, no models."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from mlx_serving.serving import Batch


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


class CountdownBackend:
    """Iterative fake: a row with payload ``n`` emits n-1, ..., 0, one per step; done at 0.

    slots: most rows admitted at once (``free_slots``); max_steps: rows with a larger ``n`` can
    never fit and are rejected; step_delay: seconds each step sleeps. Records per step the active
    row ids, each admission, and cancelled ids.
    """

    def __init__(self, slots: int | None = None, max_steps: int | None = None, step_delay: float = 0.0,
                 fail_on: int | None = None):
        self.slots, self.max_steps, self.step_delay, self.fail_on = slots, max_steps, step_delay, fail_on
        self.steps: list[list[int]] = []
        self.admissions: list[list[int]] = []
        self.cancelled: list[int] = []
        self.threads: set[str] = set()
        self.inits: list[tuple[str, int]] = []
        self.states: list[dict] = []

    def init(self, mode: str, arg: Any, partitions: int) -> dict:
        self.inits.append((mode, partitions))
        self.states.append({"rows": {}})
        return self.states[-1]

    def admit(self, state: dict, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]:
        self.threads.add(threading.current_thread().name)
        self.admissions.append([row_id for row_id, _ in rows])
        rejected: list[tuple[int, BaseException]] = []
        for row_id, n in rows:
            if self.max_steps is not None and n > self.max_steps:
                rejected.append((row_id, ValueError(f"a row of {n} steps never fits (max {self.max_steps})")))
            else:
                state["rows"][row_id] = int(n)
        return rejected

    def free_slots(self, state: dict) -> int:
        return 1 << 30 if self.slots is None else self.slots - len(state["rows"])

    def step(self, state: dict) -> list[tuple[int, Any, bool]]:
        self.threads.add(threading.current_thread().name)
        self.steps.append(sorted(state["rows"]))
        if self.step_delay:
            time.sleep(self.step_delay)
        events = []
        for row_id in list(state["rows"]):
            left = state["rows"][row_id] - 1
            if left == self.fail_on:
                raise RuntimeError(f"step failed at {left}")
            events.append((row_id, left, left == 0))
            if left == 0:
                del state["rows"][row_id]
            else:
                state["rows"][row_id] = left
        return events

    def cancel(self, state: dict, row_ids: list[int]) -> None:
        for row_id in row_ids:
            state["rows"].pop(row_id, None)
        self.cancelled.extend(row_ids)

    def active(self, state: dict) -> int:
        return len(state["rows"])


def countdown(*ns: int) -> Batch:
    """One row per step count."""
    return Batch.stack(list(ns))


class QueueingCountdown(CountdownBackend):
    """A CountdownBackend with its own scheduler (``waiting``): ``admit`` queues rows; each step
    first starts the shortest queued rows (fewest steps; ties by arrival) while fewer than ``slots``
    run, then counts down the running ones. Records the most rows ever running at once and the
    order rows started in."""

    def __init__(self, slots: int, step_delay: float = 0.0):
        super().__init__(slots=slots, step_delay=step_delay)
        self.most_running = 0
        self.started: list[int] = []
        self.lock = threading.Lock()  # guards the records read by the test thread

    def init(self, mode: str, arg: Any, partitions: int) -> dict:
        state = super().init(mode, arg, partitions)
        state["queue"] = {}
        return state

    def admit(self, state: dict, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]:
        self.admissions.append([row_id for row_id, _ in rows])
        state["queue"].update((row_id, int(n)) for row_id, n in rows)
        return []

    def free_slots(self, state: dict) -> int:
        return max(0, self.slots - len(state["rows"]) - len(state["queue"]))

    def waiting(self, state: dict) -> int:
        return len(state["queue"])

    def step(self, state: dict) -> list[tuple[int, Any, bool]]:
        queue = state["queue"]
        for row_id in sorted(queue, key=lambda r: (queue[r], r))[: self.slots - len(state["rows"])]:
            state["rows"][row_id] = queue.pop(row_id)
            with self.lock:
                self.started.append(row_id)
        with self.lock:
            self.most_running = max(self.most_running, len(state["rows"]))
        return super().step(state)

    def cancel(self, state: dict, row_ids: list[int]) -> None:
        for row_id in row_ids:
            state["queue"].pop(row_id, None)
        super().cancel(state, row_ids)

    def active(self, state: dict) -> int:
        return len(state["rows"]) + len(state["queue"])
