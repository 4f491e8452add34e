"""``Serving``: an immutable description of what to run and how; inline and process mode."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypedDict, TypeVar, Unpack, overload

import anyio
import anyio.lowlevel

from ._backend import Backend, FunctionBackend, IterativeBackend, is_backend, is_iterative
from ._batch import Batch
from ._client import AsyncStream, EventTransducer, LocalClient, Stream, Transducer
from ._contract import Client
from ._handle import ServingHandle, lookup
from ._inline import InlineClient, InlineRuntime
from ._options import ProcessOptions
from ._telemetry import Callback, ServingStats, timed

_UNSET: Any = object()

In = TypeVar("In")  # what a caller passes (``run(input)``)
Out = TypeVar("Out")  # what a call returns (the postprocessed result)
In2 = TypeVar("In2")
Out2 = TypeVar("Out2")


def _default_preprocessing(input: object) -> tuple[Batch, None]:
    if not isinstance(input, Batch):
        raise TypeError(f"without client_preprocessing the input must be a Batch, got {type(input).__name__}")
    return input, None


def _default_postprocessing(result: tuple[Any, object], info: object) -> Any:
    return result[0]


class _Settings(TypedDict, total=False):
    """The keyword arguments of ``Serving.__init__`` that the builders change."""

    preprocessing: Callable[[Any], tuple[Batch, Any]]
    postprocessing: Callable[[tuple[Any, Any], Any], Any]
    batch_size: int | None
    options: ProcessOptions
    factory: Callable[[Any], Transducer[Any]] | None
    telemetry: Callback | None
    offload: Callable[[Any], bool] | None


class Serving(Generic[In, Out]):
    """What to run (a function or a backend) plus client pre/postprocessing and batching options.

    ``Serving[In, Out]``: callers pass ``In`` (a ``Batch`` until ``client_preprocessing`` is set)
    and get ``Out`` (the backend's output until ``client_postprocessing`` is set).

    Builders (``client_preprocessing``, ``batch_size``, ...) return a new Serving. Run it inline
    with ``Serving.run(serving, input)`` / ``serving.run(input)`` (the backend's ``init`` runs once,
    lazily, on the serving's own executor thread), or start it with ``Serving.start(serving, ...)``
    and call ``Serving.batched_run(handle_or_name, input)`` from any number of threads or tasks.
    """

    __slots__ = ("_backend", "_arg", "_pre", "_post", "_batch_size", "_options", "_factory",
                 "_telemetry", "_offload_fn", "_inline", "__weakref__")

    def __init__(self, backend: Backend | IterativeBackend, arg: object = None, *,
                 preprocessing: Callable[[In], tuple[Batch, Any]] = _default_preprocessing,
                 postprocessing: Callable[[tuple[Any, Any], Any], Out] = _default_postprocessing,
                 batch_size: int | None = None, options: ProcessOptions = ProcessOptions(),
                 factory: Callable[[Any], Transducer[Any]] | None = None, telemetry: Callback | None = None,
                 offload: Callable[[In], bool] | None = None):
        self._backend, self._arg = backend, arg
        self._pre, self._post = preprocessing, postprocessing
        self._batch_size, self._options, self._factory, self._telemetry = batch_size, options, factory, telemetry
        self._offload_fn = offload
        runtime = InlineRuntime(backend, arg, batch_size, telemetry)
        self._inline: InlineClient[In, Out] = InlineClient(self, runtime)
        weakref.finalize(self, runtime.close)  # a backstop only: close() (or ``with``) is the way

    @classmethod
    def new(cls: type[Serving[Any, Any]], fn_or_backend: Callable[[Batch], object] | Backend | IterativeBackend,
            arg: object = None) -> Serving[Batch, Any]:
        """``new(fn)``: ``fn(batch)`` returns one leading entry per row (array/dict/tuple or a list).
        ``new(backend, arg)``: a ``Backend`` or ``IterativeBackend``; ``arg`` goes to its ``init``.
        Raises ``TypeError`` for anything else."""
        if is_backend(fn_or_backend):
            return cls(fn_or_backend, arg)
        if callable(fn_or_backend):
            if arg is not None:
                raise TypeError("Serving.new(fn) takes no arg; pass a Backend to use one")
            return cls(FunctionBackend(fn_or_backend))
        raise TypeError(f"expected a function or a Backend, got {type(fn_or_backend).__name__}")

    def _replace(self, **changes: Unpack[_Settings]) -> Serving[Any, Any]:
        fields = _Settings(preprocessing=self._pre, postprocessing=self._post, batch_size=self._batch_size,
                           options=self._options, factory=self._factory, telemetry=self._telemetry,
                           offload=self._offload_fn)
        fields.update(changes)
        return Serving(self._backend, self._arg, **fields)

    # ---- builders ------------------------------------------------------------------------------
    @overload
    def client_preprocessing(self, fn: None, *, offload: Callable[[Batch], bool] | None = None) -> Serving[Batch, Out]: ...

    @overload
    def client_preprocessing(self, fn: Callable[[In2], tuple[Batch, Any]], *,
                             offload: Callable[[In2], bool] | None = None) -> Serving[In2, Out]: ...

    def client_preprocessing(self, fn: Callable[[In2], tuple[Batch, Any]] | None, *,
                             offload: Callable[[In2], bool] | None = None) -> Serving[In2, Out] | Serving[Batch, Out]:
        """``fn(input) -> (Batch, info)`` runs in the caller; None restores "input is a Batch".

        ``offload(input) -> bool``: True when ``fn`` may hold the caller for long (more than
        ~10 ms, e.g. tokenizing a long prompt); async callers (``run_async``,
        ``stream_async``) then run ``fn`` on a worker thread instead of the event loop."""
        return self._replace(preprocessing=fn or _default_preprocessing, offload=offload)

    @overload
    def client_postprocessing(self, fn: None) -> Serving[In, Any]: ...

    @overload
    def client_postprocessing(self, fn: Callable[[tuple[Any, Any], Any], Out2]) -> Serving[In, Out2]: ...

    def client_postprocessing(self, fn: Callable[[tuple[Any, Any], Any], Out2] | None) -> Serving[In, Out2] | Serving[In, Any]:
        """``fn((output, metadata), info) -> result`` runs in the caller; None returns ``output``."""
        return self._replace(postprocessing=fn or _default_postprocessing)

    def batch_size(self, n: int) -> Serving[In, Out]:
        """Most rows per executed batch, inline and in process mode (``ValueError`` if < 1)."""
        if n < 1:
            raise ValueError(f"batch_size must be >= 1, got {n}")
        return self._replace(batch_size=n)

    def process_options(self, **options: object) -> Serving[In, Out]:
        """Defaults for ``start`` (the fields of ``ProcessOptions``; unknown names: ``TypeError``)."""
        return self._replace(options=self._options.merge(**options))

    def streaming(self, factory: Callable[[Any], Transducer[Any]]) -> Serving[In, Out]:
        """For an ``IterativeBackend``: ``factory(info)`` builds each request's transducer."""
        if not is_iterative(self._backend):
            raise TypeError("streaming(factory) needs an IterativeBackend")
        return self._replace(factory=factory)

    def telemetry(self, callback: Callback | None) -> Serving[In, Out]:
        """``callback(TelemetryEvent)`` for every preprocessing / execute / step / postprocessing."""
        return self._replace(telemetry=callback)

    # ---- used by calls -------------------------------------------------------------------------
    @property
    def _is_iterative(self) -> bool:
        return is_iterative(self._backend)

    def _preprocess(self, input: In) -> tuple[Batch, object]:
        with timed(self._telemetry, "preprocessing", 0):
            result = self._pre(input)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Batch)):
            raise TypeError("client_preprocessing must return (Batch, info)")
        return result

    def _offload(self, input: In) -> bool:
        return self._offload_fn is not None and bool(self._offload_fn(input))

    def _postprocess(self, result: tuple[Any, Any], info: object) -> Out:
        return self._post(result, info)

    def _transducer_for(self, info: object) -> Transducer[Any]:
        return EventTransducer() if self._factory is None else self._factory(info)

    # ---- the client contract, inline (``Serving.run(serving, input)``) -------------------------
    # Called on the class with another client as the first argument (``Serving.run(handle, x)``,
    # ``Serving.stream("name", x)``) each verb is a thin call onto that client.
    def run(self, input: In, *, deadline: float | None = None) -> Out:
        """Run inline (no batching across callers): preprocess, split by batch_size, execute on
        the serving's executor thread, reassemble, postprocess. Raises ``BackendError`` (cause
        chained) if the backend fails, or what preprocessing raised."""
        return client(self).run(input, deadline=deadline)

    async def run_async(self, input: In, *, deadline: float | None = None) -> Out:
        """``run`` for asyncio/trio: model work stays on the serving's executor thread."""
        return await client(self).run_async(input, deadline=deadline)

    def stream(self, input: In, *, deadline: float | None = None) -> Stream[Any]:
        """Submit now; a ``Stream`` of items as they arrive; closing it withdraws the request."""
        return client(self).stream(input, deadline=deadline)

    async def stream_async(self, input: In, *, deadline: float | None = None) -> AsyncStream[Any]:
        """Submit now (off the loop when ``offload`` says so); an ``AsyncStream``."""
        return await client(self).stream_async(input, deadline=deadline)

    def stats(self) -> ServingStats:
        """``ServingStats`` of the inline runs (of the client, when called on the class)."""
        return client(self).stats()

    def close(self) -> None:
        """End the inline executor thread (after queued runs); later inline calls raise
        ``ServingStopped``. Handles started from this serving are not affected."""
        client(self).close()

    async def aclose(self) -> None:
        """``close`` off the event loop."""
        await client(self).aclose()

    def __enter__(self) -> Serving[In, Out]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Serving[In, Out]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- process mode --------------------------------------------------------------------------
    def start(self, name: str | None = None, *, batch_size: int | None = None, batch_timeout: float | None = None,
              batch_keys: Sequence[Hashable] | None = None, partitions: int | None = None,
              max_queue: int | None = _UNSET, shutdown_timeout: float | None = None) -> ServingHandle[In, Out]:
        """Start in process mode; given options override ``process_options`` (see ``ProcessOptions``).

        ``name`` registers the handle for ``Serving.batched_run(name, ...)`` (``ValueError`` if
        taken). Blocks until the backend's ``init`` has run. Raises ``ValueError`` if
        ``batch_size`` disagrees with ``Serving.batch_size`` or an option is out of range, and
        whatever ``init`` raised.
        """
        given = dict(batch_size=batch_size, batch_timeout=batch_timeout, batch_keys=batch_keys,
                     partitions=partitions, shutdown_timeout=shutdown_timeout)
        overrides: dict[str, object] = {k: v for k, v in given.items() if v is not None}
        if max_queue is not _UNSET:
            overrides["max_queue"] = max_queue
        opts = self._options.merge(**overrides)
        if opts.batch_size is not None and self._batch_size is not None and opts.batch_size != self._batch_size:
            raise ValueError(f"batch_size {opts.batch_size} disagrees with the serving's batch_size {self._batch_size}")
        opts = opts.merge(batch_size=opts.batch_size or self._batch_size or 1)
        return ServingHandle(self, name, opts)

    async def start_async(self, name: str | None = None, *, batch_size: int | None = None,
                          batch_timeout: float | None = None, batch_keys: Sequence[Hashable] | None = None,
                          partitions: int | None = None, max_queue: int | None = _UNSET,
                          shutdown_timeout: float | None = None) -> ServingHandle[In, Out]:
        """``start`` for asyncio/trio: the backend's ``init`` (loading, warming up: seconds on a
        GPU) runs on a worker thread while the event loop keeps serving. Same options, result
        and errors as ``start``. Cancelled while ``init`` runs, it waits for ``init`` to end,
        stops the new handle (so nothing is left running) and re-raises the cancellation.
        """
        started: list[ServingHandle[In, Out]] = []

        def run() -> ServingHandle[In, Out]:
            started.append(self.start(name, batch_size=batch_size, batch_timeout=batch_timeout, batch_keys=batch_keys,
                                      partitions=partitions, max_queue=max_queue, shutdown_timeout=shutdown_timeout))
            return started[0]

        try:
            handle = await anyio.to_thread.run_sync(run)
            await anyio.lowlevel.checkpoint_if_cancelled()  # a cancel that came during init lands here
            return handle
        except BaseException:
            if started:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(started[0].close)
            raise

    @overload
    @staticmethod
    def batched_run(name_or_client: Client[In2, Out2], input: In2, *, deadline: float | None = None) -> Out2: ...

    @overload
    @staticmethod
    def batched_run(name_or_client: str, input: object, *, deadline: float | None = None) -> Any: ...

    @staticmethod
    def batched_run(name_or_client: str | Client[In2, Out2], input: In2, *, deadline: float | None = None) -> Out2:
        """Blocking, thread-safe call of a started serving (by name) or any client."""
        return client(name_or_client).run(input, deadline=deadline)

    @overload
    @staticmethod
    async def batched_run_async(name_or_client: Client[In2, Out2], input: In2, *,
                                deadline: float | None = None) -> Out2: ...

    @overload
    @staticmethod
    async def batched_run_async(name_or_client: str, input: object, *, deadline: float | None = None) -> Any: ...

    @staticmethod
    async def batched_run_async(name_or_client: str | Client[In2, Out2], input: In2, *,
                                deadline: float | None = None) -> Out2:
        """Async twin of ``batched_run`` (asyncio or trio)."""
        return await client(name_or_client).run_async(input, deadline=deadline)

    def __repr__(self) -> str:
        return f"Serving(backend={type(self._backend).__name__}, batch_size={self._batch_size})"


def client(target: Serving[In, Out] | Client[In, Out] | str) -> Client[In, Out]:
    """The client a static entry point calls: a Serving's inline client, a registered name's
    handle, or the client itself (a handle, a pool). ``TypeError`` for anything else."""
    if isinstance(target, LocalClient):  # a handle: checked first, a Protocol check costs ~5 us
        return target
    if isinstance(target, Serving):
        return target._inline
    if isinstance(target, str):
        return lookup(target)
    if isinstance(target, Client):
        return target
    raise TypeError(f"expected a Serving, a client (handle, pool) or a serving name, got {type(target).__name__}")
