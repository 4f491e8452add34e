"""``Executor``: one long-lived thread that runs submitted jobs in order (it owns model work)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_CLOSE: Any = object()
_EXIT_WAIT_S = 5.0  # how long interpreter exit waits for executor threads to end
_live: weakref.WeakSet[Executor] = weakref.WeakSet()
_threads: set[threading.Thread] = set()  # every executor thread not yet seen gone


def _os_thread_gone(thread: threading.Thread) -> bool:
    """True once the OS thread has ended, thread-local destructors included (Linux: its
    /proc/self/task entry is gone; elsewhere: ``is_alive`` is the best available signal)."""
    if sys.platform.startswith("linux") and thread.native_id is not None:
        return not os.path.exists(f"/proc/self/task/{thread.native_id}")
    return not thread.is_alive()


@atexit.register
def _close_all() -> None:
    """End executor threads before interpreter teardown.

    A thread that ran ``mx.compile``d code destroys MLX's thread-local compile cache when it
    exits, and that destructor takes the GIL: during interpreter finalization this aborts the
    process ("terminate called without an active exception"). So exit waits, bounded, until
    every executor thread has fully ended while the interpreter is still alive.
    """
    for executor in list(_live):
        executor.close()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for thread in list(_threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        while not _os_thread_gone(thread) and time.monotonic() < deadline:
            time.sleep(0.001)


class Executor:
    """A daemon thread with a FIFO of jobs. ``close()`` lets queued jobs finish, then ends it."""

    def __init__(self, name: str):
        self._cond = threading.Condition(threading.Lock())
        self._jobs: deque[Any] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live.add(self)
        _threads.difference_update([t for t in _threads if _os_thread_gone(t)])
        _threads.add(self._thread)

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
