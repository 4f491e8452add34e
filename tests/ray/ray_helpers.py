"""Helpers of the Ray tests (imported by name: the test folder is on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(predicate: Callable[[], object], timeout: float = 120.0) -> None:
    """Poll ``predicate`` every 50 ms until it is truthy; AssertionError after ``timeout`` seconds
    (a cap that only ends a hang: shared, busy machines are slow)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
