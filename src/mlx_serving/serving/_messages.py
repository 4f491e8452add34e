"""Typed messages on a request's channel, from the executor thread to the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Part", "RowEvent"]


@dataclass(slots=True)
class Part:
    """A static batch's output holding some of one caller's rows.

    The caller's rows are ``output[start:start + size]``; they are rows ``offset..offset+size-1``
    of the caller's own batch. ``metadata`` is the batch's, unsliced.
    """

    offset: int
    output: Any
    metadata: Any
    start: int
    size: int


@dataclass(slots=True)
class RowEvent:
    """One event of an iterative backend for row ``row`` (0-based within the caller's request)."""

    row: int
    event: Any
