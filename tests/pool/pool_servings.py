"""Servings for the pool tests and bench. Spawned workers import this module by name: tests/pool
is on sys.path in the test process (pytest's rootdir-relative import), and spawned workers get the
parent's sys.path."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlx_serving.serving import Batch, InvalidInput, Serving

SPAWNED_MARK = "set only in the test process"  # the tests overwrite it; a spawned worker sees this


def _rows(value: Any) -> tuple[Batch, None]:
    return Batch.concatenate([np.asarray(value)]), None


def _one(value: Any) -> tuple[Batch, None]:
    return Batch.stack([value]), None


def _first(output_metadata: tuple[Any, Any], info: Any) -> Any:
    return output_metadata[0][0]


def _output(output_metadata: tuple[Any, Any], info: Any) -> Any:
    return output_metadata[0]


def double() -> Serving:
    """Rows of a numpy array (leading axis) times two."""
    return Serving.new(lambda batch: batch.data * 2).client_preprocessing(_rows).client_postprocessing(_output)


def _probe_rows(batch: Batch) -> list[dict[str, Any]]:
    return [
        {"pid": os.getpid(), "env": os.environ.get("POOL_TEST_VAR"), "mark": SPAWNED_MARK, "rows": batch.size}
        for _ in range(batch.size)
    ]


def probe() -> Serving:
    """Any input -> the worker's pid, POOL_TEST_VAR, this module's SPAWNED_MARK, the batch size."""
    return Serving.new(_probe_rows).client_preprocessing(_one).client_postprocessing(_first)


def _sleep_rows(batch: Batch) -> list[dict[str, Any]]:
    """Each row is (seconds, tag, log path or None): sleep the longest, then log each tag."""
    rows = batch.rows()
    time.sleep(max(seconds for seconds, _, _ in rows))
    for _, tag, log in rows:
        if log:
            with Path(log).open("a") as file:
                file.write(f"{tag}\n")
    return [{"pid": os.getpid(), "tag": tag} for _, tag, _ in rows]


def sleeper() -> Serving:
    """(seconds, tag, log path or None) -> {"pid", "tag"} after sleeping."""
    return Serving.new(_sleep_rows).client_preprocessing(_one).client_postprocessing(_first)


class NeedsTwoArgs(Exception):
    """Pickles, but cannot be rebuilt (``__init__`` needs two arguments)."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(a)
        self.b = b


class HoldsALock(Exception):
    """Cannot be pickled at all."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        import threading

        self.lock = threading.Lock()


def _raise(value: tuple[str | None, int]) -> tuple[Batch, None]:
    kind, n = value
    if kind == "value":
        raise ValueError(f"bad value {n}")
    if kind == "invalid":
        raise InvalidInput(f"max_new_tokens must be an integer >= 1, got {n}", "max_new_tokens")
    if kind == "two_args":
        raise NeedsTwoArgs("first", "second")
    if kind == "lock":
        raise HoldsALock("holds a lock")
    return _one(value)


def raiser() -> Serving:
    """(kind, n) with kind "value" | "invalid" | "two_args" | "lock" | None: raises in client preprocessing
    (in the worker), or returns the input."""
    return Serving.new(lambda batch: batch.rows()).client_preprocessing(_raise).client_postprocessing(_first)


def cpu_bound(size: int = 160) -> Serving:
    """A pure-Python loop that holds the GIL: each row is a seed; returns one float per row."""

    def work(batch: Batch) -> list[float]:
        out = []
        for seed in batch.rows():
            acc = 0.0
            for i in range(size * 1000):
                acc += (i * seed) % 7
            out.append(acc)
        return out

    return Serving.new(work).client_preprocessing(_one).client_postprocessing(_first)


class Counter:
    """Iterative backend: a row ``n`` emits 1, 2, ..., n, one per 20 ms step."""

    def init(self, mode: str, arg: Any, partitions: int) -> dict[int, list[int]]:
        return {}

    def admit(self, state: dict[int, list[int]], rows: list[tuple[int, Any]], partition: int) -> list:
        for row_id, n in rows:
            state[row_id] = [0, n]
        return []

    def free_slots(self, state: dict[int, list[int]]) -> int:
        return 64

    def step(self, state: dict[int, list[int]]) -> list[tuple[int, int, bool]]:
        time.sleep(0.02)
        events = []
        for row_id, row in list(state.items()):
            row[0] += 1
            done = row[0] >= row[1]
            events.append((row_id, row[0], done))
            if done:
                del state[row_id]
        return events

    def cancel(self, state: dict[int, list[int]], row_ids: list[int]) -> None:
        for row_id in row_ids:
            state.pop(row_id, None)

    def active(self, state: dict[int, list[int]]) -> int:
        return len(state)


def counter() -> Serving:
    """n -> stream of (0, 1), (0, 2), ..., (0, n) (row index, count)."""
    return Serving.new(Counter()).client_preprocessing(_one)


def broken() -> Serving:
    """A factory that fails."""
    raise RuntimeError("the factory could not load its model")


def _fail_on_negative(batch: Batch) -> Any:
    if any(n < 0 for n in batch.rows()):
        raise RuntimeError("negative input")
    return batch.rows()


def failing() -> Serving:
    """n -> n; a negative n makes the backend raise (``BackendError`` in the caller)."""
    return Serving.new(_fail_on_negative).client_preprocessing(_one).client_postprocessing(_first)


def dies_at_start() -> Serving:
    """A factory whose process writes to its stderr and exits at once (no Python error)."""
    import sys

    sys.stderr.write("fatal: the model file is corrupt\n")
    sys.stderr.flush()
    os._exit(3)


class Hazard(Counter):
    """Iterative backend for the chaos tests. A row ``n >= 0`` emits the worker's pid ``n`` times,
    one per 20 ms step. Negative rows misbehave in ``step`` (on the serving's executor thread):
    ``-1`` deadlocks in native code holding the GIL (a default pthread mutex locked twice through
    ``ctypes.PyDLL``, which keeps the GIL during the call; Linux); ``-2`` runs a regular expression
    that backtracks for ever (``re`` holds the GIL while it matches); ``-3`` spins in pure Python
    for 3 s, then emits the pid once (busy, but the GIL is switched, so the loop keeps beating)."""

    def step(self, state: dict[int, list[int]]) -> list[tuple[int, int, bool]]:
        for _, n in state.values():
            if n == -1:
                _native_deadlock()
            if n == -2:
                import re

                re.match(r"(a|aa)+$", "a" * 200 + "b")
            if n == -3:
                end = time.monotonic() + 3.0
                while time.monotonic() < end:
                    pass
        time.sleep(0.02)
        events = []
        for row_id, row in list(state.items()):
            row[0] += 1
            done = row[0] >= max(row[1], 1)
            events.append((row_id, os.getpid(), done))
            if done:
                del state[row_id]
        return events


def _native_deadlock() -> None:
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held while the C function runs
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a normal mutex locked again by its owner: never returns


def hazard() -> Serving:
    """n -> stream of (0, pid) n times; negative n hangs the worker (see ``Hazard``)."""
    return Serving.new(Hazard()).client_preprocessing(_one)
