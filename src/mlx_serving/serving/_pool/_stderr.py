"""A worker's stderr: relayed to this process's stderr, its last bytes kept for error messages.

A worker that fails before its own code runs (the usual case: a script without an
``if __name__ == "__main__":`` guard, whose spawned child re-imports the main module and fails
inside multiprocessing's bootstrap) leaves its traceback only on its stderr. So each worker is
started with fd 2 pointing at a pipe, for the instant of ``process.start()`` only (the child
inherits it); a relay thread copies what the child writes to this process's fd 2, as if the child
wrote there itself, and keeps the last ``TAIL_BYTES`` for ``WorkerCrashed`` messages.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["TAIL_BYTES", "StderrRelay", "exit_report", "start_with_stderr_relay"]

TAIL_BYTES = 8192
_POLL_MS = 250  # how often an idle relay checks whether it was asked to stop
# held while fd 2 points at a pipe, and by relays writing to fd 2 (so that they never write into
# the pipe they read); a relay waiting for it only delays its child once the pipe (64 KiB) is full
_FD2_LOCK = threading.Lock()
_NO_MAIN_GUARD = "bootstrapping phase"  # in multiprocessing's RuntimeError for a re-imported main


class StderrRelay:
    """Reads a child's stderr pipe on a daemon thread: copies it to fd 2 and keeps its tail.

    The thread owns the read end and closes it when the pipe ends (every writer exited) or when
    ``close`` asks it to stop, so no fd or thread outlives ``close``.
    """

    def __init__(self, read_fd: int, name: str) -> None:
        self._fd = read_fd
        self._tail = bytearray()
        self._count = 0  # bytes relayed so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def tail(self, wait: float = 0.0) -> str:
        """The last ``TAIL_BYTES`` the child wrote (decoded, undecodable bytes replaced), after
        waiting up to ``wait`` s for the pipe to end (the child's last words)."""
        self._ended.wait(wait)
        with self._lock:
            return self._tail.decode("utf-8", "replace")

    @property
    def count(self) -> int:
        """Bytes the child has written so far."""
        return self._count

    def wait_output(self, since: int, limit: float, quiet: float = 0.1) -> None:
        """Wait until the child has written more than ``since`` bytes in all and then nothing
        for ``quiet`` s (a report written in one go has ended), ``limit`` s at most."""
        end = time.monotonic() + limit
        last, last_change = since, time.monotonic()
        while not self._ended.is_set() and (now := time.monotonic()) < end:
            if self._count != last:
                last, last_change = self._count, now
            elif last != since and now - last_change >= quiet:
                return
            time.sleep(0.01)

    def close(self, grace: float = 0.5) -> None:
        """Give the pipe ``grace`` s to end (a process still holding it is not waited for), then
        stop and join the thread. Idempotent."""
        self._ended.wait(grace)
        self._stop.set()
        self._thread.join(2.0)  # longer only while a write to a stalled stderr blocks

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS) and not self._relay():
                    break
        finally:
            os.close(self._fd)
            self._ended.set()

    def _relay(self) -> bool:
        """Copy one chunk; False at the end of the pipe."""
        try:
            data = os.read(self._fd, 65536)
        except OSError:
            return False
        if not data:
            return False
        with self._lock:
            self._tail += data
            del self._tail[:-TAIL_BYTES]
            self._count += len(data)
        with _FD2_LOCK:
            _write_all(2, data)
        return True


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd``; a closed or broken stderr drops it (the tail keeps it)."""
    view = memoryview(data)
    with contextlib.suppress(OSError):
        while view:
            view = view[os.write(fd, view) :]


def start_with_stderr_relay(start: Callable[[], None], name: str) -> StderrRelay | None:
    """Call ``start`` (which starts one child process) with fd 2 pointing at a new pipe, and
    return the relay of that pipe (thread ``name``). Returns None, after calling ``start``
    unchanged, when this process has no usable fd 2. Raises what ``start`` raised (nothing is
    left open then). Callers serialise spawns (fd 2 is process-wide); other threads writing to
    stderr meanwhile are relayed too, so nothing is lost.
    """
    try:
        saved = os.dup(2)
    except OSError:
        start()
        return None
    try:
        read_fd, write_fd = os.pipe()
    except BaseException:
        os.close(saved)
        raise
    relay = StderrRelay(read_fd, name)
    try:
        _start_redirected(start, write_fd, saved)
    except BaseException:
        relay.close(grace=0.0)
        raise
    finally:
        os.close(saved)
        os.close(write_fd)
    return relay


def _start_redirected(start: Callable[[], None], write_fd: int, saved: int) -> None:
    with _FD2_LOCK:
        _flush_stderr()
        os.dup2(write_fd, 2)
        try:
            start()
        finally:
            _flush_stderr()
            os.dup2(saved, 2)


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def exit_report(summary: str, tail: str) -> str:
    """``summary`` followed by the worker's last stderr output and, when that shows a spawned
    child re-importing a main module without a ``__main__`` guard, how to fix it."""
    if not tail.strip():
        return summary
    report = f"{summary}; the end of its stderr:\n{tail.rstrip()}"
    if _NO_MAIN_GUARD in tail:
        report += (
            "\n\nhint: the worker re-imported the caller's main module (workers start with the "
            "spawn method) and that module started a pool again while importing. Create the pool "
            "under an `if __name__ == \"__main__\":` guard (or in a function called from one)."
        )
    return report
