"""The serving error tree.

::

    ServingError
    ├── ServingStopped      the serving was stopped (or never started) before the request ran
    ├── ServingOverloaded   ``max_queue`` rows are already waiting; nothing was enqueued
    ├── RequestCancelled    the caller left (cancelled, stream closed); seen by nobody in practice
    ├── DeadlineExceeded    the request's ``deadline`` passed before it finished
    ├── BackendError        executing the batch (or step) holding this request's rows raised;
    │                       the backend's exception is chained as ``__cause__``
    ├── WorkerCrashed       a worker process died (raised by the process pool)
    │   └── WorkerUnresponsive  a pool worker stopped answering (missed heartbeats); it was killed
    └── RemoteError         an error raised in a worker process, re-raised in the caller

    ValueError
    └── InvalidInput        a request's input is refused by the serving's client preprocessing;
        │                   ``param`` names the input key at fault (not a ServingError: bad
        │                   input is the caller's ValueError)
        └── RequestTooLarge a request of more rows than ``max_queue``: it could never be
                            queued (split it; not an overload to retry)
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "DeadlineExceeded",
    "InvalidInput",
    "RemoteError",
    "RequestCancelled",
    "RequestTooLarge",
    "ServingError",
    "ServingOverloaded",
    "ServingStopped",
    "WorkerCrashed",
    "WorkerUnresponsive",
]


class ServingError(Exception):
    """Base class of every error raised by the serving runtime.

    ``request_id``: the id of the request it ended (``Stream.request_id``; ids are unique per
    process), or None for an error raised before a request existed.
    """

    request_id: int | None = None


class ServingStopped(ServingError):
    """The serving is stopped: queued requests are failed with it and new ones are refused."""


class ServingOverloaded(ServingError):
    """The queue already holds ``max_queue`` rows; the request was not enqueued."""


class RequestCancelled(ServingError):
    """The request was withdrawn because its caller left."""


class DeadlineExceeded(ServingError):
    """The request's deadline (seconds after submission) passed before it finished."""


class BackendError(ServingError):
    """The backend raised while running a batch or step holding this request's rows.

    The backend's original exception is ``__cause__``.
    """


class WorkerCrashed(ServingError):
    """A worker process exited while it held this request."""


class WorkerUnresponsive(WorkerCrashed):
    """A pool worker holding this request sent nothing (not even a heartbeat) for the pool's
    ``liveness_timeout``: it was marked unresponsive, killed and replaced."""


class RemoteError(ServingError):
    """An exception raised inside a worker process, carried back to the caller.

    ``type_name`` (qualified name of the worker's exception type), ``message`` (its ``str``) and
    ``remote_traceback`` (the worker's formatted traceback text) describe the original.
    """

    type_name: str = ""
    message: str = ""
    remote_traceback: str = ""


class InvalidInput(ValueError):
    """A request's input is refused (raised by a serving's client preprocessing, in the caller).

    ``param``: the key of the serving's input dict at fault, spelled as that dict spells it (for
    the text-generation serving: ``"max_new_tokens"``, ``"text"``, ``"messages"``,
    ``"logit_bias"``, ...), or None when no single key is at fault (an empty input list, an input
    that is not a dict). A front end maps it to its own field name (the OpenAI server answers 400
    with ``param`` ``max_tokens`` for ``max_new_tokens``).

    A ``ValueError``, so callers that catch ``ValueError`` keep working. It pickles with its
    ``param``, so it comes back as itself (param included) from a ``ServingPool`` worker process
    or a Ray actor.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[InvalidInput], tuple[str, str | None], dict[str, object]]:
        return type(self), (str(self.args[0]) if self.args else "", self.param), self.__dict__


class RequestTooLarge(InvalidInput):
    """A request of more rows (``rows``) than the serving queues at once (``max_queue``): it could
    never be enqueued, so it is refused as bad input, not as an overload to retry
    (:class:`ServingOverloaded`). ``param`` is None: which field made the rows (a list of prompts,
    ``n``, a list of embedding inputs) is the front end's to say."""

    def __init__(self, message: str, param: str | None = None, *, rows: int = 0, max_queue: int = 0) -> None:
        super().__init__(message, param)
        self.rows, self.max_queue = rows, max_queue
