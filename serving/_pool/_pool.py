"""`ServingPool`: N worker processes, each running its own copy of a Serving, behind one API."""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import anyio
import msgspec

from .._channel import END, Channel
from .._errors import DeadlineExceeded, RequestCancelled, ServingError, ServingStopped, WorkerCrashed
from .._options import ProcessOptions
from .._telemetry import ServingStats
from ._remote import rebuild_error
from ._wire import (
    Call,
    Cancel,
    End,
    Failed,
    Item,
    Ready,
    Result,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    ToWorker,
    decode_from_worker,
    decode_payload,
    encode_message,
    encode_payload,
    recv_frame,
    send_frame,
)
from ._worker import Factory, main, resolve_factory

__all__ = ["PoolStats", "ServingPool", "WorkerHealth", "WorkerStats"]

_SPAWN = multiprocessing.get_context("spawn")
_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one spawn at a time edits it
_STATS_TIMEOUT = 5.0  # seconds a worker has to answer pool.stats()
_POLL = 0.02  # seconds between checks while an async caller waits for a worker to be ready


@dataclass(frozen=True)
class WorkerHealth:
    """One worker slot. state: "starting" | "ready" | "restarting" | "closing" | "stopped".

    alive: the process runs and accepts calls. last_progress: Unix time (s) of the last answer,
    stream item or error the worker sent (its start time before any). in_flight: requests routed
    to it and not finished. restarts: times the slot's worker was replaced after dying."""

    index: int
    pid: int | None
    state: str
    alive: bool
    in_flight: int
    last_progress: float
    restarts: int


@dataclass(frozen=True)
class WorkerStats:
    """One worker's serving stats (None when it was not ready or did not answer in 5 s)."""

    index: int
    pid: int | None
    in_flight: int
    restarts: int
    serving: ServingStats | None


@dataclass(frozen=True)
class PoolStats:
    """Pool snapshot: ``total`` sums the workers' counts (``mean_batch_fill`` is weighted by each
    worker's batches + steps); ``workers`` has one entry per slot."""

    total: ServingStats
    workers: tuple[WorkerStats, ...]


class _Worker:
    """One incarnation of a slot's worker process and its connection."""

    def __init__(self, index: int, process: Any, sock: socket.socket) -> None:
        self.index = index
        self.process = process
        self.pid: int | None = process.pid
        self.sock = sock
        self.state = "starting"
        self.pending: dict[int, Channel] = {}
        self.last_progress = time.time()
        self.reader: threading.Thread | None = None
        self._send_lock = threading.Lock()

    def send(self, message: ToWorker) -> None:
        """Send one message; OSError if the worker is gone (its reader then fails its calls)."""
        frame = encode_message(message)
        with self._send_lock:
            send_frame(self.sock, frame)

    def name(self) -> str:
        """How errors name this worker."""
        return f"pool worker {self.index} (pid {self.pid})"


@dataclass
class _Slot:
    index: int
    weight: float
    env: Mapping[str, str]
    worker: _Worker | None = None
    restarts: int = 0
    restarting: bool = False
    starting: _Worker | None = None  # a replacement worker that has not reported Ready yet


class ServingPool:
    """Runs ``workers`` processes, each with its own Serving started in process mode.

    ``factory`` is an import path ``"package.module:function"`` or a picklable callable; each
    worker calls it once (in the worker) and must get a ``Serving``, which it starts with
    ``Serving.start(serving, **process_options)``. Workers start with the spawn method, so the
    factory's module must be importable in a fresh interpreter.

    worker_env: environment variables per worker, a sequence with one mapping per worker or a
      function of the worker index (e.g. ``lambda i: {"CUDA_VISIBLE_DEVICES": str(i)}``); set
      before the worker's interpreter starts, and again for a restarted worker.
    weights: routing weights (positive, one per worker; default all 1.0). A request goes to the
      ready worker with the least ``(in_flight + 1) / weight``; ties rotate.
    start_timeout: seconds a worker has to build and start its serving; also the longest a
      request waits for a worker while every worker is restarting.

    Raises the worker's exception if a factory or ``Serving.start`` fails in any worker (after
    stopping every started worker), ``TimeoutError`` if one does not start in time,
    ``WorkerCrashed`` if one dies while starting, ``ValueError`` / ``TypeError`` for bad arguments.
    """

    def __init__(
        self,
        factory: Factory,
        workers: int = 1,
        *,
        worker_env: Sequence[Mapping[str, str]] | Callable[[int], Mapping[str, str]] | None = None,
        weights: Sequence[float] | None = None,
        start_timeout: float = 120.0,
        **process_options: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        _check_factory(factory)
        # refuse bad options here rather than in every worker (``name`` is Serving.start's own)
        ProcessOptions().merge(**{k: v for k, v in process_options.items() if k != "name"})
        self._factory = factory
        self._process_options = process_options
        self._start_timeout = start_timeout
        self._shutdown_timeout = float(process_options.get("shutdown_timeout", 30.0))
        self._slots = [
            _Slot(i, w, e) for i, (w, e) in enumerate(zip(_weights(weights, workers), _envs(worker_env, workers)))
        ]
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._turn = 0
        self._closing = False
        self._closed = threading.Event()
        self._restarters: list[threading.Thread] = []
        self._start_all()

    # --- lifecycle ----------------------------------------------------------------------------

    def _start_all(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        started: list[_Worker] = []
        try:
            for slot in self._slots:
                started.append(self._spawn(slot))
            for worker in started:
                self._await_ready(worker, deadline)
        except BaseException:
            for worker in started:
                _kill(worker)
            raise
        for slot, worker in zip(self._slots, started):
            self._activate(slot, worker)

    def _spawn(self, slot: _Slot) -> _Worker:
        ours, theirs = socket.socketpair()
        process = _SPAWN.Process(
            target=main,
            args=(theirs, self._factory, self._process_options),
            name=f"serving-pool-worker-{slot.index}",
            daemon=True,
        )
        try:
            with _ENV_LOCK, _environment(slot.env):
                process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Worker(slot.index, process, ours)

    def _await_ready(self, worker: _Worker, deadline: float) -> None:
        """Wait for the worker's first message; raise its start error, or on death / timeout."""
        worker.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            frame = recv_frame(worker.sock)
        except TimeoutError:
            raise TimeoutError(f"{worker.name()} did not start within {self._start_timeout} s") from None
        except OSError:
            frame = None
        worker.sock.settimeout(None)
        if frame is None:
            worker.process.join(5.0)
            raise WorkerCrashed(f"{worker.name()} exited with code {worker.process.exitcode} while starting")
        message = decode_from_worker(frame)
        if isinstance(message, StartFailed):
            worker.process.join(5.0)
            raise rebuild_error(message.error, worker.name())
        if not isinstance(message, Ready):
            raise WorkerCrashed(f"{worker.name()} sent {type(message).__name__} before Ready")

    def _activate(self, slot: _Slot, worker: _Worker) -> None:
        """Route to ``worker`` from now on and start reading its messages."""
        worker.state = "ready"
        worker.last_progress = time.time()
        worker.reader = threading.Thread(
            target=self._read, args=(worker,), name=f"serving-pool-reader-{slot.index}", daemon=True
        )
        with self._cond:
            slot.worker = worker
            self._cond.notify_all()
        worker.reader.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (up to ``timeout`` s, default the
        ``shutdown_timeout`` process option or 30), then stop every worker and wait for its exit;
        a worker still alive 5 s after that is killed. Requests still unfinished then fail with
        ``ServingStopped``. Idempotent; requests made after it raise ``ServingStopped``."""
        timeout = self._shutdown_timeout if timeout is None else timeout
        with self._cond:
            if self._closing:
                first = False
            else:
                first = self._closing = True
                self._cond.notify_all()
            workers = [s.worker for s in self._slots if s.worker is not None]
        if not first:
            self._closed.wait()
            return
        for worker in workers:
            with self._cond:
                live = worker.state == "ready"
                worker.state = "closing" if live else worker.state
            if live:
                with contextlib.suppress(OSError):
                    worker.send(Shutdown(timeout))
        with self._cond:
            starting = [s.starting for s in self._slots if s.starting is not None]
        for worker in starting:
            _kill(worker)
        for thread in list(self._restarters):
            thread.join()
        deadline = time.monotonic() + timeout + 5.0
        for slot in self._slots:
            if slot.worker is not None:
                _finish(slot.worker, deadline)
        self._closed.set()

    async def aclose(self, timeout: float | None = None) -> None:
        """``close`` without blocking the event loop."""
        await anyio.to_thread.run_sync(self.close, timeout)

    def __enter__(self) -> ServingPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> ServingPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- the connection to one worker ---------------------------------------------------------

    def _read(self, worker: _Worker) -> None:
        try:
            while (frame := recv_frame(worker.sock)) is not None:
                self._deliver(worker, decode_from_worker(frame))
        except (OSError, msgspec.DecodeError):
            pass  # a broken or corrupt connection counts as a dead worker
        self._lost(worker)

    def _deliver(self, worker: _Worker, message: Any) -> None:
        if isinstance(message, Item):
            channel = worker.pending.get(message.id)
            if channel is not None:
                channel.put(message.payload)
        elif isinstance(message, (Result, End, Failed, StatsReply)):
            with self._cond:
                channel = worker.pending.pop(message.id, None)
            if channel is None:
                return  # its caller left
            if isinstance(message, Failed):
                channel.close(rebuild_error(message.error, worker.name()))
                return
            if isinstance(message, (Result, StatsReply)):
                channel.put(message.payload if isinstance(message, Result) else message.stats)
            channel.close()
        else:
            return
        worker.last_progress = time.time()

    def _lost(self, worker: _Worker) -> None:
        """The worker's connection ended: fail its calls, and replace it unless closing."""
        with self._cond:
            closing = worker.state == "closing"
            worker.state = "stopped"
            pending, worker.pending = worker.pending, {}
            slot = self._slots[worker.index]
            restart = not self._closing and slot.worker is worker
            slot.restarting = restart
            if restart:
                thread = threading.Thread(
                    target=self._restart, args=(slot,), name=f"serving-pool-restart-{slot.index}", daemon=True
                )
                thread.start()
                self._restarters.append(thread)
            self._cond.notify_all()
        worker.process.join(1.0)
        code = worker.process.exitcode
        for call_id, channel in pending.items():
            if closing and code == 0:
                error: Exception = ServingStopped(f"{worker.name()} stopped before request {call_id} finished")
            else:
                error = WorkerCrashed(f"{worker.name()} exited with code {code} while running request {call_id}")
            channel.close(error)

    def _restart(self, slot: _Slot) -> None:
        """Start a new worker for ``slot``, retrying with backoff (0.5 s doubling to 30 s)."""
        delay = 0.0
        while not self._closing:
            if delay:
                with self._cond:
                    self._cond.wait_for(lambda: self._closing, delay)
                if self._closing:
                    break
            try:
                worker = self._spawn(slot)
            except Exception:
                delay = min(max(delay * 2, 0.5), 30.0)
                continue
            with self._cond:
                slot.starting = worker  # close() kills it rather than wait for its start
                closing = self._closing
            try:
                if closing:
                    raise ServingStopped("the pool is closing")
                self._await_ready(worker, time.monotonic() + self._start_timeout)
            except Exception:
                _kill(worker)
                delay = min(max(delay * 2, 0.5), 30.0)
                continue
            finally:
                with self._cond:
                    slot.starting = None
            with self._cond:
                if not self._closing:
                    slot.restarts += 1
                    slot.restarting = False
                    self._activate(slot, worker)
                    return
            _kill(worker)
            break
        with self._cond:
            slot.restarting = False
            self._cond.notify_all()

    # --- routing and calls --------------------------------------------------------------------

    def _pick(self) -> _Worker | None:
        """The ready worker with the least (in_flight + 1) / weight; the start rotates for ties."""
        if self._closing:
            raise ServingStopped("the pool is closed")
        best, best_score = None, math.inf
        count = len(self._slots)
        self._turn = (self._turn + 1) % count
        for offset in range(count):
            slot = self._slots[(self._turn + offset) % count]
            worker = slot.worker
            if worker is not None and worker.state == "ready":
                score = (len(worker.pending) + 1) / slot.weight
                if score < best_score:
                    best, best_score = worker, score
        return best

    def _submit(self, payload: msgspec.Raw, stream: bool, deadline: float | None) -> tuple[_Worker, int, Channel]:
        start = time.monotonic()
        with self._cond:
            while (worker := self._pick()) is None:
                if not self._cond.wait(self._wait_limit(start, deadline)):
                    raise self._no_worker(start, deadline)
            call_id, channel = self._register(worker)
        self._send_call(worker, call_id, payload, stream, _remaining(start, deadline))
        return worker, call_id, channel

    async def _submit_async(
        self, payload: msgspec.Raw, stream: bool, deadline: float | None
    ) -> tuple[_Worker, int, Channel]:
        start = time.monotonic()
        while True:
            with self._cond:
                worker = self._pick()
                if worker is not None:
                    call_id, channel = self._register(worker)
                    break
            if self._wait_limit(start, deadline) <= 0:
                raise self._no_worker(start, deadline)
            await anyio.sleep(_POLL)
        self._send_call(worker, call_id, payload, stream, _remaining(start, deadline))
        return worker, call_id, channel

    def _wait_limit(self, start: float, deadline: float | None) -> float:
        """Seconds a caller may still wait for a ready worker."""
        limit = self._start_timeout if deadline is None else min(self._start_timeout, deadline)
        return start + limit - time.monotonic()

    def _no_worker(self, start: float, deadline: float | None) -> ServingError:
        if deadline is not None and deadline <= self._start_timeout:
            return DeadlineExceeded(f"no pool worker became ready within the deadline ({deadline} s)")
        return WorkerCrashed(f"no pool worker became ready within {self._start_timeout} s")

    def _register(self, worker: _Worker) -> tuple[int, Channel]:
        """Register a call on ``worker`` (lock held); the caller sends it outside the lock."""
        call_id = next(self._ids)
        channel = Channel()
        worker.pending[call_id] = channel
        return call_id, channel

    @staticmethod
    def _send_call(worker: _Worker, call_id: int, payload: msgspec.Raw, stream: bool, deadline: float | None) -> None:
        try:
            worker.send(Call(call_id, stream, payload, deadline))
        except OSError:
            pass  # the worker died; its reader fails this call with WorkerCrashed

    def _cancel(self, worker: _Worker, call_id: int) -> None:
        """The caller left: forget the call and tell the worker to drop or stop it."""
        with self._cond:
            channel = worker.pending.pop(call_id, None)
        if channel is None:
            return  # already finished
        channel.close(RequestCancelled(f"request {call_id} was cancelled by its caller"))
        with contextlib.suppress(OSError):
            worker.send(Cancel(call_id))

    def run(self, input: Any, *, deadline: float | None = None) -> Any:
        """Run one request on the least-loaded worker and return its result (blocks; thread-safe).

        The worker runs ``batched_run`` on its serving: client preprocessing, batching with other
        requests routed to it, execution and client postprocessing all happen in the worker.
        ``input`` and the result travel as described in the wire format (numpy arrays without
        pickle). Raises what the worker's serving raised (see ``rebuild_error``), ``WorkerCrashed``
        if the worker died holding the request, ``ServingStopped`` once closed, ``TypeError`` /
        ``ValueError`` if the input or the result cannot cross the process boundary,
        ``DeadlineExceeded`` when ``deadline`` (seconds from this call, enforced by the worker's
        serving) passes first. An interrupted caller (e.g. ``KeyboardInterrupt``) cancels the
        request in the worker.
        """
        payload = encode_payload(input)
        worker, call_id, channel = self._submit(payload, False, deadline)
        try:
            result = channel.get()
        except BaseException:
            if not channel.closed:
                self._cancel(worker, call_id)
            raise
        return decode_payload(result)

    async def run_async(self, input: Any, *, deadline: float | None = None) -> Any:
        """``run`` for asyncio or trio; cancelling the caller cancels the request in the worker."""
        payload = encode_payload(input)
        worker, call_id, channel = await self._submit_async(payload, False, deadline)
        try:
            result = await channel.aget()
        except BaseException:
            if not channel.closed:
                self._cancel(worker, call_id)
            raise
        return decode_payload(result)

    def stream(self, input: Any, *, deadline: float | None = None) -> Iterator[Any]:
        """Iterate the items of one streaming request (``stream_async`` of the worker's handle).

        The request is sent on the first ``next()``; closing the iterator early (``break``,
        garbage collection) cancels it in the worker. Raises as ``run``."""
        payload = encode_payload(input)
        worker, call_id, channel = self._submit(payload, True, deadline)
        try:
            while (item := channel.get()) is not END:
                yield decode_payload(item)
        finally:
            if not channel.closed:
                self._cancel(worker, call_id)

    async def stream_async(self, input: Any, *, deadline: float | None = None) -> AsyncIterator[Any]:
        """``stream`` for asyncio or trio; cancellation or ``aclose()`` cancels the request."""
        payload = encode_payload(input)
        worker, call_id, channel = await self._submit_async(payload, True, deadline)
        try:
            while (item := await channel.aget()) is not END:
                yield decode_payload(item)
        finally:
            if not channel.closed:
                self._cancel(worker, call_id)

    # --- observation --------------------------------------------------------------------------

    def health(self) -> list[WorkerHealth]:
        """One `WorkerHealth` per worker slot (no round trip to the workers)."""
        with self._cond:
            return [self._health(slot) for slot in self._slots]

    def _health(self, slot: _Slot) -> WorkerHealth:
        worker = slot.worker
        if worker is None:
            return WorkerHealth(slot.index, None, "starting", False, 0, time.time(), slot.restarts)
        state = "restarting" if slot.restarting else worker.state
        alive = worker.state == "ready" and worker.process.is_alive()
        return WorkerHealth(
            slot.index, worker.pid, state, alive, len(worker.pending), worker.last_progress, slot.restarts
        )

    def stats(self) -> PoolStats:
        """Ask every ready worker for its serving stats (5 s each at most) and add them up."""
        queries = []
        with self._cond:
            for slot in self._slots:
                worker = slot.worker
                if worker is not None and worker.state == "ready":
                    queries.append((slot, worker, *self._register(worker)))
                else:
                    queries.append((slot, worker, None, None))
        for _, worker, call_id, _ in queries:
            if call_id is not None:
                with contextlib.suppress(OSError):
                    worker.send(StatsQuery(call_id))
        deadline = time.monotonic() + _STATS_TIMEOUT
        per_worker = [self._collect(q, deadline) for q in queries]
        answered = [w.serving for w in per_worker if w.serving is not None]
        return PoolStats(_sum_stats(answered), tuple(per_worker))

    def _collect(self, query: tuple[Any, ...], deadline: float) -> WorkerStats:
        slot, worker, call_id, channel = query
        serving = None
        if channel is not None:
            try:
                serving = ServingStats(**channel.get(max(deadline - time.monotonic(), 0.0)))
            except (TimeoutError, WorkerCrashed, ServingStopped):
                self._cancel(worker, call_id)
        pid = worker.pid if worker is not None else None
        in_flight = len(worker.pending) if worker is not None else 0
        return WorkerStats(slot.index, pid, in_flight, slot.restarts, serving)


def _remaining(start: float, deadline: float | None) -> float | None:
    """What is left of a caller's ``deadline`` (seconds from ``start``), at least 0."""
    return None if deadline is None else max(start + deadline - time.monotonic(), 0.0)


def _sum_stats(stats: list[ServingStats]) -> ServingStats:
    totals = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(ServingStats)}
    work = [s.batches_run + s.steps_run for s in stats]
    totals["mean_batch_fill"] = (
        sum(s.mean_batch_fill * w for s, w in zip(stats, work)) / sum(work) if sum(work) else 0.0
    )
    return ServingStats(**totals)


def _check_factory(factory: Factory) -> None:
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"factory import path must look like 'package.module:function', got {factory!r}")
        return
    resolve_factory(factory)
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            f"factory must be an import path 'package.module:function' or a picklable callable "
            f"(workers start with the spawn method): {exc!r}"
        ) from exc


def _weights(weights: Sequence[float] | None, workers: int) -> list[float]:
    if weights is None:
        return [1.0] * workers
    weights = [float(w) for w in weights]
    if len(weights) != workers or not all(w > 0 and math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be {workers} positive finite numbers, got {weights}")
    return weights


def _envs(
    worker_env: Sequence[Mapping[str, str]] | Callable[[int], Mapping[str, str]] | None, workers: int
) -> list[Mapping[str, str]]:
    if worker_env is None:
        return [{}] * workers
    envs = [worker_env(i) for i in range(workers)] if callable(worker_env) else list(worker_env)
    if len(envs) != workers:
        raise ValueError(f"worker_env must give one mapping per worker ({workers}), got {len(envs)}")
    for env in envs:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError(f"worker_env values must map str to str, got {env!r}")
    return envs


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in os.environ for the block (the spawned interpreter inherits it)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _kill(worker: _Worker) -> None:
    """Kill a worker that holds no calls and reap it."""
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(5.0)
    worker.sock.close()


def _finish(worker: _Worker, deadline: float) -> None:
    """Wait for a stopping worker to exit (kill it at ``deadline``) and for its reader to end."""
    worker.process.join(max(deadline - time.monotonic(), 0.0))
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(5.0)
    if worker.reader is not None:
        worker.reader.join(5.0)
    worker.sock.close()
