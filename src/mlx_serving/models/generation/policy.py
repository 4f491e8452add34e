"""Scheduling policies: who of the waiting sequences starts next, and who is preempted when KV
blocks run out (vLLM v1's ``sched/request_queue.py`` shape: a small queue object per policy).

- :class:`FCFSPolicy`: first come, first served; the newest running sequence is preempted.
- :class:`PriorityPolicy`: lowest ``priority`` value first (ties: arrival order); the running
  sequence with the highest ``(priority, start order)`` is preempted.

A preempted sequence goes back to the waiting queue ahead of every later arrival of its priority
(FCFS: at the front). Items need ``priority`` and ``arrival`` (an increasing add counter) and,
for preemption, ``order`` (an increasing start counter) attributes: the :class:`Schedulable`
protocol (the scheduler's ``Request`` is one).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Iterator, Protocol, TypeVar

__all__ = ["FCFSPolicy", "Policy", "PriorityPolicy", "Schedulable", "make_policy"]


class Schedulable(Protocol):
    """What a policy reads of a queued sequence."""

    priority: int  # lower first under the "priority" policy
    arrival: int  # an increasing add counter
    order: int  # an increasing start counter (preemption picks the newest)


S = TypeVar("S", bound=Schedulable)


class Policy(Protocol[S]):
    """The waiting queue of an engine plus its preemption choice."""

    def push(self, seq: S) -> None: ...  # a new arrival
    def requeue(self, seq: S) -> None: ...  # a preempted sequence (ahead of later arrivals)
    def peek(self) -> S: ...
    def pop(self) -> S: ...
    def remove(self, seq: S) -> None: ...
    def victim(self, running: list[S]) -> S: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[S]: ...


class FCFSPolicy(Generic[S]):
    """First come, first served."""

    name = "fcfs"

    def __init__(self) -> None:
        self._q: deque[S] = deque()

    def push(self, seq: S) -> None:
        self._q.append(seq)

    def requeue(self, seq: S) -> None:
        self._q.appendleft(seq)

    def peek(self) -> S:
        return self._q[0]

    def pop(self) -> S:
        return self._q.popleft()

    def remove(self, seq: S) -> None:
        self._q.remove(seq)

    def victim(self, running: list[S]) -> S:
        """The newest started sequence."""
        return max(running, key=lambda s: s.order)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[S]:
        return iter(self._q)


class PriorityPolicy(Generic[S]):
    """Lowest ``priority`` first, then arrival order (a heap; removal is lazy)."""

    name = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, S]] = []
        self._live: dict[int, tuple[int, int, int, S]] = {}
        self._n = 0

    def _key(self, seq: S) -> tuple[int, int]:
        return (seq.priority, seq.arrival)

    def push(self, seq: S) -> None:
        self._n += 1
        entry = (*self._key(seq), self._n, seq)
        self._live[id(seq)] = entry
        heapq.heappush(self._heap, entry)

    requeue = push  # its (priority, arrival) key already puts it ahead of later arrivals

    def _clean(self) -> None:
        while self._heap and self._live.get(id(self._heap[0][3])) is not self._heap[0]:
            heapq.heappop(self._heap)

    def peek(self) -> S:
        self._clean()
        return self._heap[0][3]

    def pop(self) -> S:
        self._clean()
        entry = heapq.heappop(self._heap)
        del self._live[id(entry[3])]
        return entry[3]

    def remove(self, seq: S) -> None:
        del self._live[id(seq)]

    def victim(self, running: list[S]) -> S:
        """The lowest-priority running sequence (the newest started among equals)."""
        return max(running, key=lambda s: (s.priority, s.order))

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[S]:
        return (e[3] for e in sorted(self._live.values(), key=lambda e: e[:3]))


def make_policy(policy: str | Policy[S]) -> Policy[S]:
    """``"fcfs"``, ``"priority"`` or a policy object."""
    if policy == "fcfs":
        return FCFSPolicy()
    if policy == "priority":
        return PriorityPolicy()
    if isinstance(policy, str):
        raise ValueError(f"policy must be 'fcfs', 'priority' or a Policy object, got {policy!r}")
    return policy
