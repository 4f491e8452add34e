"""``ServingHandle``: a serving started in process mode, and the process-local name registry."""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from concurrent.futures import wait
from functools import partial
from typing import Any, TypeVar

from ._backend import is_iterative
from ._batch import Batch
from ._client import LocalClient, Runtime, ServingSpec
from ._errors import ServingStopped
from ._executor import Executor
from ._iterative import IterativeScheduler, close_state
from ._options import ProcessOptions
from ._static import StaticScheduler
from ._telemetry import ServingStats

In = TypeVar("In")
Out = TypeVar("Out")

_registry: dict[str, ServingHandle[Any, Any]] = {}
_registry_lock = threading.Lock()
_anonymous = itertools.count()
_live: weakref.WeakSet[ServingHandle[Any, Any]] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, end handles left running: refuse and fail their work at once, so the
    partition loops return and the executors' own exit hook can join their threads."""
    for handle in list(_live):
        handle._stop_now()


def lookup(name: str) -> ServingHandle[Any, Any]:
    """The running serving registered under ``name`` (``ServingStopped`` if none)."""
    with _registry_lock:
        handle = _registry.get(name)
    if handle is None:
        raise ServingStopped(f"no running serving is named {name!r}")
    return handle


class ServingHandle(LocalClient[In, Out]):
    """A started serving: batches rows from many callers on its partition threads.

    Implements the client contract (``Client``: run / run_async / stream / stream_async /
    stats / close / aclose). Use it as a context manager (``with`` or ``async with``) or call
    ``close()``. Every method is thread-safe. ``deadline`` (seconds from the call) bounds one
    request: past it the request is withdrawn and ``DeadlineExceeded`` is raised.
    """

    def __init__(self, serving: ServingSpec[In, Out], name: str | None, options: ProcessOptions):
        self._serving, self._name, self._options = serving, name, options
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._register()
        label = name or f"serving-{next(_anonymous)}"
        self._executors = [Executor(f"{label}-p{i}") for i in range(options.partitions)]
        try:
            self._scheduler = self._init_scheduler()
        except BaseException:
            self._close_executors()
            self._unregister()
            raise
        for i, executor in enumerate(self._executors):
            executor.submit(partial(self._run_partition, i))
        _live.add(self)

    def _run_partition(self, index: int) -> None:
        """Partition ``index``'s executor job: its step loop, then (iterative backends) its state's release."""
        scheduler = self._scheduler
        try:
            scheduler.run_partition(index)
        finally:
            if isinstance(scheduler, IterativeScheduler):
                scheduler.release(index)

    def _register(self) -> None:
        if self._name is None:
            return
        with _registry_lock:
            if self._name in _registry:
                raise ValueError(f"a serving named {self._name!r} is already running")
            _registry[self._name] = self

    def _unregister(self) -> None:
        with _registry_lock:
            if self._name is not None and _registry.get(self._name) is self:
                del _registry[self._name]

    def _init_scheduler(self) -> StaticScheduler | IterativeScheduler:
        s, opts = self._serving, self._options
        n, size = opts.partitions, opts.batch_size or 1
        backend = s._backend

        def init() -> Any:
            return backend.init("process", s._arg, n)

        if is_iterative(backend):  # one state per partition, built on its own thread
            futures = [ex.submit(init) for ex in self._executors]
            wait(futures)
            failed = [e for f in futures if (e := f.exception()) is not None]
            if failed:  # release the partitions that did build, each on its own thread, then raise
                for ex, f in zip(self._executors, futures):
                    if f.exception() is None:
                        ex.submit(partial(close_state, backend, f.result()))
                raise failed[0]
            return IterativeScheduler(backend, [f.result() for f in futures], opts, size, s._telemetry)
        return StaticScheduler(backend, self._executors[0].submit(init).result(), opts, size, s._telemetry)

    @property
    def name(self) -> str | None:
        """The registered name (None for an anonymous serving)."""
        return self._name

    @property
    def options(self) -> ProcessOptions:
        """The effective process options."""
        return self._options

    def _check(self, batch: Batch) -> None:
        if batch.batch_key not in self._options.batch_keys:
            raise ValueError(f"unknown batch key {batch.batch_key!r}; this serving accepts {self._options.batch_keys}")

    def _runtime(self) -> Runtime:
        return self._scheduler

    def stats(self) -> ServingStats:
        """Queue depth, running rows, batches/steps run, fill, and request outcome counters."""
        return self._scheduler.stats()

    def close(self) -> None:
        """Refuse new calls and fail queued ones with ServingStopped at once; let running work
        finish for up to ``shutdown_timeout`` seconds, then fail it with ServingStopped; end the
        partition threads, each after an iterative backend's optional ``close(state)`` on it.
        Past the timeout this returns without waiting for a step still running: that partition
        ends, and releases its state, when the step returns. Idempotent."""
        if not self._begin_stop():
            return
        self._close_executors()
        end = time.monotonic() + self._options.shutdown_timeout
        if not all(ex.join(max(end - time.monotonic(), 0.0)) for ex in self._executors):
            self._scheduler.abort()

    def _stop_now(self) -> None:
        """``close`` without waiting: running work is failed with ServingStopped too."""
        if self._begin_stop():
            self._scheduler.abort()
            self._close_executors()

    def _begin_stop(self) -> bool:
        """Mark stopped, unregister, refuse new requests; False if already stopped."""
        with self._stop_lock:
            if self._stopped:
                return False
            self._stopped = True
        self._unregister()
        self._scheduler.stop()
        return True

    def _close_executors(self) -> None:
        for executor in self._executors:
            executor.close()

    def __repr__(self) -> str:
        return f"ServingHandle(name={self._name!r}, stopped={self._stopped})"
