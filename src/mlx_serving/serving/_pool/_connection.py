"""``ProcessWorker``: one worker process of a ``ProcessBackend`` and its socket connection (the
calls sent, the answers read by its reader thread, its loss reported to the pool)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import msgspec

from .._errors import ServingError, ServingStopped, WorkerCrashed
from .._request import Request, reap
from .._telemetry import ServingStats
from ._backend import PoolEvents, PoolWorker
from ._base import fail, remote_deadline
from ._remote import rebuild_error
from ._stderr import StderrRelay, exit_report
from ._wire import (
    Call,
    Cancel,
    End,
    Failed,
    Item,
    Result,
    StatsQuery,
    StatsReply,
    ToWorker,
    decode_from_worker,
    decode_payload,
    encode_message,
    recv_frame,
    send_frame,
)

__all__ = ["ProcessWorker", "WireConsumer", "finish", "kill"]

_TAIL_WAIT = 0.5  # seconds to wait for a dead worker's last stderr output


class WireConsumer:
    """The ``Consumer`` of a pool request: every channel message is one payload the worker sent
    (a stream item, or a call's result), decoded here in the caller."""

    live = True

    def on_message(self, message: object) -> list[object]:
        """The decoded payload (``message`` is the ``msgspec.Raw`` the worker sent); ``ValueError``
        if it cannot be decoded."""
        return [decode_payload(cast(msgspec.Raw, message))]

    def finish(self) -> list[object]:
        return []

    def result(self, items: list[object]) -> object:
        """A non-streamed call's result: its one message."""
        return items[0]


class ProcessWorker(PoolWorker):
    """One incarnation of a slot's worker process and its connection."""

    def __init__(self, index: int, process: Any, sock: socket.socket, relay: StderrRelay | None,
                 lock: threading.Condition, orphans: deque[Request], events: PoolEvents) -> None:
        super().__init__(index, lock, orphans)
        self.process = process
        self.pid = process.pid
        self.sock = sock
        self.relay = relay
        self.heard_at = time.monotonic()  # monotonic time of its last message, for the liveness check
        self.reader: threading.Thread | None = None
        self._events = events
        self._send_lock = threading.Lock()
        self._released = False
        self._disposed = False

    # --- calls --------------------------------------------------------------------------------

    def post(self, message: ToWorker) -> None:
        """Send one message; OSError if the worker is gone (its reader then fails its calls)."""
        frame = encode_message(message)
        with self._send_lock:
            send_frame(self.sock, frame)

    def send(self, request: Request, payload: object, stream: bool) -> None:
        """Send the call (``payload``: the encoded input); a dead worker's reader fails it."""
        with contextlib.suppress(OSError):
            self.post(Call(request.id, stream, cast(msgspec.Raw, payload), remote_deadline(request)))

    def withdraw(self, request: Request, error: BaseException) -> None:
        """Forget the call and tell the worker to drop or stop it (nothing is sent for a call that
        already finished)."""
        with self.lock:
            held = self.pending.pop(request.id, None) is not None
        if held:
            with contextlib.suppress(OSError):
                self.post(Cancel(request.id))

    def ask_stats(self) -> Callable[[float], ServingStats | None]:
        query = Request(1, None)
        with self.lock:
            self.pending[query.id] = query
            self.queries.add(query.id)
        with contextlib.suppress(OSError):
            self.post(StatsQuery(query.id))

        def answer(timeout: float) -> ServingStats | None:
            try:
                return ServingStats(**query.channel.get(timeout))
            except (TimeoutError, ServingError):
                with self.lock:
                    self.pending.pop(query.id, None)
                return None
            finally:
                self.queries.discard(query.id)

        return answer

    def is_alive(self) -> bool:
        return bool(self.process.is_alive())

    def name(self) -> str:
        return f"pool worker {self.index} (pid {self.pid})"

    def stderr_tail(self, wait: float = 0.0) -> str:
        """The last output of the process on its stderr ("" when it was not captured)."""
        return "" if self.relay is None else self.relay.tail(wait)

    # --- answers ------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start reading the worker's messages (its reader thread)."""
        self.heard_at = time.monotonic()
        self.reader = threading.Thread(target=self._read, name=f"serving-pool-reader-{self.index}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while (frame := recv_frame(self.sock)) is not None:
                self.heard_at = time.monotonic()
                self.last_heartbeat = time.time()
                self._deliver(decode_from_worker(frame))
                if self.orphans:
                    reap(self.orphans)
        except (OSError, msgspec.DecodeError):
            pass  # a broken or corrupt connection counts as a dead worker
        self._lost()

    def _deliver(self, message: Any) -> None:
        if isinstance(message, Item):
            request = self.pending.get(message.id)
            if request is not None:
                request.channel.put(message.payload)
        elif isinstance(message, (Result, End, Failed, StatsReply)):
            with self.lock:
                request = self.pending.pop(message.id, None)
            if request is not None:  # else its caller left
                _answer(request, message, self.name())
        else:
            return
        self.last_progress = time.time()

    def _lost(self) -> None:
        """The connection ended: fail the calls, release it; the pool replaces the worker unless
        closing (or the liveness monitor did already)."""
        previous, pending = self._events.detach(self, "stopped", "restarting") or ("stopped", {})
        self.process.join(1.0)
        code = self.process.exitcode
        stopped = previous == "closing" and code == 0
        tail = "" if stopped or code is None or not pending else self.stderr_tail(_TAIL_WAIT)
        self._events.retire(self, 0 if stopped else self.calls(pending))
        for request in pending.values():
            if stopped:
                error: ServingError = ServingStopped(f"{self.name()} stopped before request {request.id} finished")
            else:
                summary = f"{self.name()} exited with code {code} while running request {request.id}"
                error = WorkerCrashed(exit_report(summary, tail))
            fail(request, error)
        if code is not None:
            self.release()
        elif not self._events.closing:
            kill(self)  # alive behind a broken connection: its replacement takes over

    # --- teardown -----------------------------------------------------------------------------

    def release(self) -> None:
        """Close the connection and stop relaying stderr (the process has exited or is being
        replaced). Idempotent; any thread."""
        with self._send_lock:
            if self._released:
                return
            self._released = True
            self.sock.close()
        if self.relay is not None:
            self.relay.close()

    def dispose(self) -> None:
        """``release``, then free the process object (its sentinel fd) if the process exited.
        Call it where no other thread can still use ``process`` (``pid`` stays readable)."""
        self.release()
        if not self._disposed and self.process.exitcode is not None:
            self._disposed = True
            self.process.close()


def _answer(request: Request, message: Result | End | Failed | StatsReply, where: str) -> None:
    """Finish ``request`` with the worker's last message for it."""
    if isinstance(message, Failed):
        fail(request, rebuild_error(message.error, where))
        return
    if isinstance(message, Result):
        request.channel.put(message.payload)
    elif isinstance(message, StatsReply):
        request.channel.put(message.stats)
    request.channel.close()


def kill(worker: ProcessWorker) -> None:
    """Kill a worker that holds no calls, reap it and release it (disposed of when no reader
    thread was ever started for it)."""
    with contextlib.suppress(ValueError):  # ValueError: its process object was closed already
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(5.0)
    if worker.reader is None:
        worker.dispose()
    else:
        worker.release()


def finish(worker: ProcessWorker, deadline: float) -> None:
    """Wait for a stopping worker to exit (kill it at ``deadline``) and for its reader to end;
    dispose of it."""
    worker.process.join(max(deadline - time.monotonic(), 0.0))
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(5.0)
    if worker.reader is not None:
        worker.reader.join(5.0)
    if worker.reader is None or not worker.reader.is_alive():
        worker.dispose()
    else:
        worker.release()
