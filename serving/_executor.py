"""``Executor``: one long-lived thread that runs submitted jobs in order (it owns model work)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_CLOSE: Any = object()


class Executor:
    """A daemon thread with a FIFO of jobs. ``close()`` lets queued jobs finish, then ends it."""

    def __init__(self, name: str):
        self._cond = threading.Condition(threading.Lock())
        self._jobs: deque[Any] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; its result or exception lands in the returned future."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("executor is closed")
            self._jobs.append((fn, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Refuse new jobs; the thread exits after the queued ones."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._jobs.append(_CLOSE)
                self._cond.notify()

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to end; True if it did within ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs)
                job = self._jobs.popleft()
            if job is _CLOSE:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # the job's caller gets it; the thread lives on
                future.set_exception(exc)
            else:
                future.set_result(result)
