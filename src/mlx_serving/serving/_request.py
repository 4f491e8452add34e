"""``Request``: one caller's submission as the schedulers see it."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Any, Protocol

from ._channel import Channel
from ._errors import DeadlineExceeded, RequestCancelled, ServingError

_ids = itertools.count(1)


class Owner(Protocol):
    """The runtime holding a request's rows (a scheduler, the inline runtime, a pool).

    ``orphans``: requests whose stream was dropped unclosed. A finalizer may run inside any
    thread at any allocation (cyclic GC), even one holding a scheduler or channel lock, so it
    only appends there (atomic); the owner cancels them at its next safe point (``reap``).
    """

    orphans: deque[Request]

    def withdraw(self, request: Request, error: BaseException) -> None: ...

    def stop_rows(self, request: Request, indices: list[int]) -> None: ...


def reap(orphans: deque[Request]) -> None:
    """Cancel the requests in ``orphans`` (call holding no scheduler or channel lock)."""
    while orphans:
        try:
            request = orphans.popleft()
        except IndexError:
            return
        request.cancel()


#: A deadline further away than this (seconds, ~32 years) is no deadline: the blocking waits of
#: the threads and event loops cannot represent much longer ones (``threading.TIMEOUT_MAX``).
MAX_DEADLINE_S = 1e9


def check_deadline(deadline_s: object) -> None:
    """``ValueError`` unless ``deadline_s`` is None or a finite number of seconds > 0 (not a
    bool): NaN compares false everywhere. One over :data:`MAX_DEADLINE_S` means no deadline."""
    if deadline_s is None:
        return
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)):
        raise ValueError(f"deadline must be a number of seconds or None, got {type(deadline_s).__name__}")
    if not (math.isfinite(deadline_s) and deadline_s > 0):
        raise ValueError(f"deadline must be a finite number of seconds > 0, got {deadline_s!r}")


class Request:
    """Rows of one call, their channel back to the caller, and an optional deadline.

    ``id``: unique in the process, carried by every error the request ends with.
    ``deadline`` is absolute (``time.monotonic()`` seconds) or None. ``fail`` closes the channel
    with an error and withdraws whatever rows are still queued or running.
    """

    __slots__ = ("id", "channel", "size", "deadline", "submitted", "owner", "delivered", "rows", "rows_left")

    def __init__(self, size: int, deadline_s: float | None):
        check_deadline(deadline_s)
        self.id = next(_ids)
        self.channel: Channel[Any] = Channel()  # Part, RowEvent or a pool's payload / reply
        self.size = size
        self.submitted = time.monotonic()
        far = deadline_s is None or deadline_s > MAX_DEADLINE_S
        self.deadline = None if deadline_s is None or far else self.submitted + deadline_s
        self.owner: Owner | None = None
        self.delivered = 0  # static: rows whose output was delivered
        self.rows: list[Any] = []  # iterative: the scheduler's row records
        self.rows_left = size  # iterative: rows not finished or stopped

    @property
    def done(self) -> bool:
        return self.channel.closed

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None without one)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def fail(self, error: BaseException) -> bool:
        """Close with ``error`` (tagged with this request's id) and withdraw the rest of the
        rows; False if already done."""
        if isinstance(error, ServingError) and error.request_id is None:
            error.request_id = self.id
        if not self.channel.close(error):
            return False
        if self.owner is not None:
            self.owner.withdraw(self, error)
        return True

    def cancel(self) -> None:
        """The caller left: withdraw (no-op when the request already finished)."""
        if not self.channel.closed:
            self.fail(RequestCancelled(f"request {self.id} was cancelled by its caller"))

    def cancel_later(self) -> None:
        """Cancel from a finalizer: queue on the owner's orphans (takes no lock)."""
        if not self.channel.closed and self.owner is not None:
            self.owner.orphans.append(self)

    def expire(self) -> None:
        self.fail(DeadlineExceeded(f"request {self.id}'s deadline passed"))

    def stop_rows(self, indices: list[int]) -> None:
        """Ask the owner to end these rows now (client-side stop, e.g. a stop string)."""
        if self.owner is not None and indices and not self.done:
            self.owner.stop_rows(self, indices)
