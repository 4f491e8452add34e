"""Backend protocols: what a serving runs on its executor threads."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeGuard, TypeVar, runtime_checkable

from ._batch import Batch

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["Backend", "IterativeBackend", "FunctionBackend", "Mode", "is_iterative"]

Mode = Literal["inline", "process"]

State = TypeVar("State")  # what a backend's ``init`` builds and its other methods receive
R = TypeVar("R")


@runtime_checkable
class Backend(Protocol[State]):
    """A static backend: runs one whole batch at a time.

    ``init`` is called once per serving (inline: lazily on the first run; process mode: in
    ``Serving.start``) on the executor thread of partition 0, with ``partitions`` = how many
    partitions will call ``handle_batch``. ``handle_batch`` runs on partition ``partition``'s
    executor thread and returns ``(output, metadata)``: ``output`` has one leading entry per row of
    ``batch.data`` (an array, a dict or tuple of arrays, or a list of per-row results); rows past
    ``batch.size`` (padding) are dropped. ``metadata`` reaches every caller of the batch unsliced.
    ``Backend[State]``: ``State`` is what ``init`` returns and ``handle_batch`` receives.
    """

    def init(self, mode: Mode, arg: object, partitions: int) -> State: ...

    def handle_batch(self, batch: Batch, partition: int, state: State) -> tuple[object, object]: ...


@runtime_checkable
class IterativeBackend(Protocol[State]):
    """An iterative backend (continuous batching): rows join and leave between steps.

    Every method runs on the executor thread of the partition that owns ``state``. ``init`` is
    called once per partition on that partition's thread (``partitions`` is the total), so each
    partition has its own state and its own step loop (``IterativeBackend[State]``: the type
    ``init`` returns and every other method receives).

    - ``admit(state, rows, partition)``: add ``rows`` = ``[(row_id, payload)]`` to the running
      set; return ``[(row_id, error)]`` for rows that can never fit (each fails only its caller,
      with that error).
    - ``free_slots(state)``: how many more rows may be admitted now (e.g. KV budget).
    - ``step(state)``: one step for all running rows, returning ``[(row_id, event, done)]``;
      ``done=True`` marks a row's last event and the row leaves the running set.
    - ``cancel(state, row_ids)``: remove these rows now and free their memory; ids it does not
      hold are ignored (after an ``admit`` that raised, the scheduler cancels the whole group).
    - ``active(state)``: rows admitted and not finished.
    - optional ``waiting(state) -> int``: the backend has its own scheduler: it accepts rows it
      cannot start yet, orders them by its own policy and reports here how many it holds unstarted
      (called on the partition's thread). Its ``active`` counts the rows it holds, started or not,
      and ``free_slots`` of an idle state (nothing active) is the most rows it runs at once. When
      that is at most ``batch_size`` the serving hands it every queued row (one queue, the
      backend's); otherwise it holds it to ``batch_size`` rows, started or not, so ``batch_size``
      bounds the rows running. Handed rows not started count as queued (``max_queue``,
      ``ServingStats.queued``). See ``serving._admission``.
    - optional ``stats(state) -> Mapping[str, float]``: the backend's own counters, reported in
      ``ServingStats.backend`` (summed over partitions). Called from any thread: read plain
      counters only (also after ``close``).
    - optional ``close(state)``: called once per built state on its partition's thread when the
      serving stops (process mode: after the partition's step loop ends, or when another
      partition's ``init`` failed; inline: on ``close()``): release the state's resources (device
      memory) there. Rows still active were already failed with ServingStopped. Errors are logged.
    """

    def init(self, mode: Mode, arg: object, partitions: int) -> State: ...

    def admit(self, state: State, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]: ...

    def free_slots(self, state: State) -> int: ...

    def step(self, state: State) -> list[tuple[int, Any, bool]]: ...

    def cancel(self, state: State, row_ids: list[int]) -> None: ...

    def active(self, state: State) -> int: ...


class QueueingBackend(IterativeBackend[State], Protocol[State]):
    """An ``IterativeBackend`` with the optional ``waiting(state)`` (it orders its own queue)."""

    def waiting(self, state: State) -> int: ...


def is_iterative(backend: object) -> TypeIs[IterativeBackend[Any]]:
    """True for an object implementing the iterative protocol (it has ``admit`` and ``step``)."""
    return callable(getattr(backend, "admit", None)) and callable(getattr(backend, "step", None))


def is_backend(obj: object) -> TypeGuard[Backend[Any] | IterativeBackend[Any]]:
    """True for a ``Backend`` (``init`` and ``handle_batch``) or an ``IterativeBackend``."""
    return callable(getattr(obj, "init", None)) and (
        is_iterative(obj) or callable(getattr(obj, "handle_batch", None))
    )


def is_queueing(backend: IterativeBackend[State]) -> TypeGuard[QueueingBackend[State]]:
    """True for an iterative backend with its own scheduler (a ``waiting`` method)."""
    return callable(getattr(backend, "waiting", None))


class FunctionBackend(Generic[R]):
    """The backend of ``Serving.new(fn)``: ``fn(batch) -> output``; metadata is None."""

    def __init__(self, fn: Callable[[Batch], R]):
        self._fn = fn

    def init(self, mode: Mode, arg: object, partitions: int) -> None:
        return None

    def handle_batch(self, batch: Batch, partition: int, state: object) -> tuple[R, None]:
        return self._fn(batch), None
