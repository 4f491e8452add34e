"""`ServingPool`: N worker processes, each running its own copy of a Serving, behind the one
client contract (``Client``: run / run_async / stream / stream_async / stats / close / aclose)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import anyio
import msgspec

from .._errors import ServingError, ServingStopped, WorkerCrashed, WorkerUnresponsive
from .._options import ProcessOptions
from .._request import Request, reap
from .._telemetry import ServingStats
from ._base import PoolClient, refuse
from ._remote import rebuild_error
from ._spawn import WorkerProcess
from ._stats import NO_STATS, PoolStats, WorkerHealth, WorkerStats, retire, sum_stats
from ._stderr import StderrRelay, exit_report, start_with_stderr_relay
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

__all__ = ["ServingPool", "WireConsumer"]

_SPAWN_LOCK = threading.Lock()  # os.environ and fd 2 are process-wide: one spawn at a time edits them
_STATS_TIMEOUT = 5.0  # seconds a worker has to answer pool.stats()
_POLL = 0.02  # seconds between checks while an async caller waits for a worker to be ready
_MIN_DEADLINE = 0.001  # the worker refuses a deadline <= 0; the caller enforces the real one anyway
_TAIL_WAIT = 0.5  # seconds to wait for a dead worker's last stderr output
_DUMP_WAIT = 0.5  # seconds an unresponsive worker has to write its stacks (SIGUSR1) before SIGKILL
_HEARTBEAT = 1.0  # default heartbeat interval (s), or a quarter of liveness_timeout when shorter


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


class _Worker:
    """One incarnation of a slot's worker process and its connection; the ``Owner`` (see
    ``serving._request``) of the requests routed to it."""

    def __init__(self, index: int, process: Any, sock: socket.socket, relay: StderrRelay | None,
                 lock: threading.Condition, orphans: deque[Request]) -> None:
        self.index = index
        self.process = process
        self.pid: int | None = process.pid
        self.sock = sock
        self.relay = relay
        self.state = "starting"
        self.pending: dict[int, Request] = {}  # by request id, which is also the wire call id
        self.orphans = orphans  # the pool's: requests whose stream was dropped unclosed
        self.last_progress = time.time()
        self.last_heartbeat = time.time()  # Unix time of its last message of any kind
        self.heard_at = time.monotonic()  # the same, for the liveness check
        self.reader: threading.Thread | None = None
        self.last_stats: ServingStats | None = None  # its latest answer to a stats query
        self.queries: set[int] = set()  # ids in ``pending`` that are stats queries, not calls
        self._lock = lock  # the pool's condition: guards ``pending`` and ``state``
        self._send_lock = threading.Lock()
        self._released = False
        self._disposed = False

    def send(self, message: ToWorker) -> None:
        """Send one message; OSError if the worker is gone (its reader then fails its calls)."""
        frame = encode_message(message)
        with self._send_lock:
            send_frame(self.sock, frame)

    def withdraw(self, request: Request, error: BaseException) -> None:
        """The caller left or its deadline passed: forget the call and tell the worker to drop or
        stop it (nothing is sent for a call that already finished)."""
        with self._lock:
            held = self.pending.pop(request.id, None) is not None
        if held:
            with contextlib.suppress(OSError):
                self.send(Cancel(request.id))

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        """Raises TypeError: a pool call's transducer runs in the worker, which stops its rows."""
        raise TypeError("a pool request cannot stop rows from the caller; the worker's serving does")

    def stderr_tail(self, wait: float = 0.0) -> str:
        """The last output of the process on its stderr ("" when it was not captured)."""
        return "" if self.relay is None else self.relay.tail(wait)

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

    def name(self) -> str:
        """How errors name this worker."""
        return f"pool worker {self.index} (pid {self.pid})"


class _Slot:
    def __init__(self, index: int, weight: float, env: Mapping[str, str]) -> None:
        self.index, self.weight, self.env = index, weight, env
        self.worker: _Worker | None = None
        self.restarts = 0
        self.restarting = False
        self.cause = "restarting"  # what health() calls the slot while restarting ("unresponsive")
        self.starting: _Worker | None = None  # a replacement worker that has not reported Ready yet


class ServingPool(PoolClient):
    """Runs ``workers`` processes, each with its own Serving started in process mode.

    Implements the client contract (``Client``): ``run`` / ``run_async`` / ``stream`` /
    ``stream_async`` / ``stats`` / ``close`` / ``aclose`` with the semantics of a
    ``ServingHandle``; ``health()`` and ``pool_stats()`` report per worker.

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
    liveness_timeout: seconds a started worker may send nothing, not even a heartbeat, before it
      is declared unresponsive (default 10; None disables the check). An unresponsive worker
      gets no new requests, its in-flight requests fail with ``WorkerUnresponsive``, it is sent
      SIGUSR1 (its threads' stacks go to its stderr), killed with SIGKILL and replaced.
    heartbeat_interval: seconds between the heartbeats of a worker's event loop (default 1, or a
      quarter of ``liveness_timeout`` when that is shorter); must be below ``liveness_timeout``.

    Raises the worker's exception if a factory or ``Serving.start`` fails in any worker (after
    stopping every started worker), ``TimeoutError`` if one does not start in time,
    ``WorkerCrashed`` if one dies while starting (its message ends with the worker's stderr),
    ``ValueError`` / ``TypeError`` for bad arguments.

    backend: "process" (this class) or "ray": ``ServingPool(factory, workers=N, backend="ray",
      ray_actor_options={...})`` returns a ``RayServingPool`` (docs/distributed.md).
    """

    # Any: ServingPool | RayServingPool, which mypy refuses for a ``__new__`` (a RayServingPool is no
    # ServingPool); a ServingPool(...) call then has mypy's type ServingPool.
    def __new__(cls, factory: Factory, workers: int = 1, *, backend: str = "process",
                ray_actor_options: dict[str, Any] | None = None, weights: Sequence[float] | None = None,
                start_timeout: float = 120.0, **options: object) -> Any:
        """``backend="ray"``: a ``mlx_serving.serving.ray.RayServingPool`` (Ray actors instead of
        processes, same contract; ``ray`` is imported only then), given ``ray_actor_options``,
        ``weights``, ``start_timeout`` and the process options."""
        if backend == "ray":
            process_only = sorted({"worker_env", "liveness_timeout", "heartbeat_interval"} & options.keys())
            if process_only:
                raise TypeError(f"{', '.join(process_only)}: options of the process backend only (Ray "
                                "detects dead actors itself; place actors with ray_actor_options)")
            from ..ray import RayServingPool

            return RayServingPool(factory, workers, ray_actor_options=ray_actor_options, weights=weights,
                                  start_timeout=start_timeout, **options)
        if backend != "process":
            raise ValueError(f"backend must be 'process' or 'ray', got {backend!r}")
        if ray_actor_options is not None:
            raise TypeError("ray_actor_options needs backend='ray'")
        return super().__new__(cls)

    def __init__(
        self,
        factory: Factory,
        workers: int = 1,
        *,
        backend: str = "process",
        ray_actor_options: dict[str, Any] | None = None,
        worker_env: Sequence[Mapping[str, str]] | Callable[[int], Mapping[str, str]] | None = None,
        weights: Sequence[float] | None = None,
        start_timeout: float = 120.0,
        liveness_timeout: float | None = 10.0,
        heartbeat_interval: float | None = None,
        **process_options: object,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._liveness_timeout, self._heartbeat_interval = _liveness(liveness_timeout, heartbeat_interval)
        _check_factory(factory)
        # refuse bad options here rather than in every worker (``name`` is Serving.start's own)
        checked = ProcessOptions().merge(**{k: v for k, v in process_options.items() if k != "name"})
        self._factory = factory
        self._process_options = process_options
        self._start_timeout = start_timeout
        self._shutdown_timeout = float(checked.shutdown_timeout)
        self._slots = [
            _Slot(i, w, e) for i, (w, e) in enumerate(zip(_weights(weights, workers), _envs(worker_env, workers)))
        ]
        self._cond = threading.Condition()
        self._orphans: deque[Request] = deque()
        self._turn = 0
        self._closing = False
        self._retired = NO_STATS  # counts of lost workers (see retire)
        self._closed = threading.Event()
        self._restarters: list[threading.Thread] = []
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._start_all()
        if self._liveness_timeout is not None:
            self._monitor = threading.Thread(
                target=self._watch, args=(self._liveness_timeout,), name="serving-pool-monitor", daemon=True
            )
            self._monitor.start()

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
        process = WorkerProcess(
            target=main,
            args=(theirs, self._factory, self._process_options, self._heartbeat_interval),
            name=f"serving-pool-worker-{slot.index}",
            daemon=True,
        )
        try:
            with _SPAWN_LOCK, _environment(slot.env):
                relay = start_with_stderr_relay(process.start, f"serving-pool-stderr-{slot.index}")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Worker(slot.index, process, ours, relay, self._cond, self._orphans)

    def _await_ready(self, worker: _Worker, deadline: float) -> None:
        """Wait for the worker's first message; raise its start error, or on death / timeout."""
        worker.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            frame = recv_frame(worker.sock)
        except TimeoutError:
            summary = f"{worker.name()} did not start within {self._start_timeout} s"
            raise TimeoutError(exit_report(summary, worker.stderr_tail())) from None
        except OSError:
            frame = None
        worker.sock.settimeout(None)
        if frame is None:
            worker.process.join(5.0)
            summary = f"{worker.name()} exited with code {worker.process.exitcode} while starting"
            raise WorkerCrashed(exit_report(summary, worker.stderr_tail(_TAIL_WAIT)))
        message = decode_from_worker(frame)
        if isinstance(message, StartFailed):
            worker.process.join(5.0)
            raise rebuild_error(message.error, worker.name())
        if not isinstance(message, Ready):
            raise WorkerCrashed(f"{worker.name()} sent {type(message).__name__} before Ready")

    def _activate(self, slot: _Slot, worker: _Worker) -> None:
        """Route to ``worker`` from now on and start reading its messages."""
        worker.state = "ready"
        worker.last_progress = worker.last_heartbeat = time.time()
        worker.heard_at = time.monotonic()
        worker.reader = threading.Thread(
            target=self._read, args=(worker,), name=f"serving-pool-reader-{slot.index}", daemon=True
        )
        with self._cond:
            slot.worker = worker
            slot.cause = "restarting"
            self._cond.notify_all()
        worker.reader.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (up to ``timeout`` s, default the
        ``shutdown_timeout`` process option or 30), then stop every worker and wait for its exit;
        a worker still alive 5 s after that is killed. Requests still unfinished then fail with
        ``ServingStopped``. Idempotent; requests made after it raise ``ServingStopped``."""
        timeout = self._shutdown_timeout if timeout is None else timeout
        with self._cond:
            first = not self._closing
            self._closing = True
            self._cond.notify_all()
            workers = [s.worker for s in self._slots if s.worker is not None]
        if not first:
            self._closed.wait()
            return
        for worker in workers:
            self._shut_down(worker, timeout)
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
        self._monitor_stop.set()  # it watched the closing workers until now
        if self._monitor is not None:
            self._monitor.join()
        self._closed.set()

    def _shut_down(self, worker: _Worker, timeout: float) -> None:
        """Ask a ready worker to finish its calls (up to ``timeout`` s) and exit."""
        with self._cond:
            live = worker.state == "ready"
            worker.state = "closing" if live else worker.state
        if live:
            with contextlib.suppress(OSError):
                worker.send(Shutdown(timeout))

    # --- the connection to one worker ---------------------------------------------------------

    def _read(self, worker: _Worker) -> None:
        try:
            while (frame := recv_frame(worker.sock)) is not None:
                worker.heard_at = time.monotonic()
                worker.last_heartbeat = time.time()
                self._deliver(worker, decode_from_worker(frame))
                if self._orphans:
                    reap(self._orphans)
        except (OSError, msgspec.DecodeError):
            pass  # a broken or corrupt connection counts as a dead worker
        self._lost(worker)

    def _deliver(self, worker: _Worker, message: Any) -> None:
        if isinstance(message, Item):
            request = worker.pending.get(message.id)
            if request is not None:
                request.channel.put(message.payload)
        elif isinstance(message, (Result, End, Failed, StatsReply)):
            with self._cond:
                request = worker.pending.pop(message.id, None)
            if request is not None:  # else its caller left
                _answer(request, message, worker.name())
        else:
            return
        worker.last_progress = time.time()

    def _lost(self, worker: _Worker) -> None:
        """The worker's connection ended: fail its calls, release it, and replace it unless the
        pool is closing."""
        closing, pending = self._detach(worker)
        worker.process.join(1.0)
        code = worker.process.exitcode
        stopped = closing and code == 0
        tail = "" if stopped or code is None or not pending else worker.stderr_tail(_TAIL_WAIT)
        self._retire(worker, 0 if stopped else _calls(worker, pending))
        for request in pending.values():
            if stopped:
                error: ServingError = ServingStopped(f"{worker.name()} stopped before request {request.id} finished")
            else:
                summary = f"{worker.name()} exited with code {code} while running request {request.id}"
                error = WorkerCrashed(exit_report(summary, tail))
            _fail(request, error)
        if code is not None:
            worker.release()
        elif not closing:
            _kill(worker)  # alive behind a broken connection: its replacement takes over

    def _detach(self, worker: _Worker) -> tuple[bool, dict[int, Request]]:
        """Mark the worker stopped and take its calls; start its replacement unless closing (or
        already started: an unresponsive worker's). Returns (whether it was closing, its calls)."""
        with self._cond:
            closing = worker.state == "closing"
            replaced = worker.state == "unresponsive"  # by the monitor, which took its calls
            worker.state = "stopped"
            pending, worker.pending = worker.pending, {}
            slot = self._slots[worker.index]
            if not replaced and slot.worker is worker:
                slot.restarting = False
                if not self._closing:
                    self._replace(slot)
            self._cond.notify_all()
        return closing, pending

    def _retire(self, worker: _Worker, crashed: int) -> None:
        """Keep a lost worker's counts in the pool's totals (``retire``), ``crashed`` calls failed."""
        with self._cond:
            self._retired = retire(self._retired, worker.last_stats, crashed)
            worker.last_stats = None  # folded once: its reader and the monitor may both report it

    def _replace(self, slot: _Slot) -> None:
        """Start the thread that replaces the slot's worker (pool lock held)."""
        slot.restarting = True
        thread = threading.Thread(
            target=self._restart, args=(slot,), name=f"serving-pool-restart-{slot.index}", daemon=True
        )
        thread.start()
        self._restarters.append(thread)

    # --- liveness -----------------------------------------------------------------------------

    def _watch(self, timeout: float) -> None:
        """The monitor thread: declare unresponsive every ready or closing worker that sent
        nothing for ``timeout`` (liveness_timeout) s; runs until ``close()`` has stopped every
        worker."""
        while True:
            wait = self._heartbeat_interval
            with self._cond:
                watched = [s.worker for s in self._slots if s.worker is not None and s.worker.state in _WATCHED]
            for worker in watched:
                silent = time.monotonic() - worker.heard_at
                if silent < timeout:
                    wait = min(wait, timeout - silent)
                elif _has_unread(worker.sock):  # it did speak: this process fell behind reading
                    wait = min(wait, 0.05)
                else:
                    self._unresponsive(worker, silent)
            if self._monitor_stop.wait(max(wait, 0.005)):
                return

    def _unresponsive(self, worker: _Worker, silent: float) -> None:
        """Stop routing to ``worker``, start its replacement, have it dump its stacks, kill it
        (SIGKILL) and fail its calls with WorkerUnresponsive. Its reader then reaps it."""
        with self._cond:
            if worker.state not in _WATCHED:  # its connection ended meanwhile
                return
            worker.state = "unresponsive"
            pending, worker.pending = worker.pending, {}
            slot = self._slots[worker.index]
            if not self._closing and slot.worker is worker:
                slot.cause = "unresponsive"
                self._replace(slot)
            self._cond.notify_all()
        relay = worker.relay
        if relay is not None and worker.pid is not None and not _is_stopped(worker.pid):
            written = relay.count
            with contextlib.suppress(OSError):
                os.kill(worker.pid, signal.SIGUSR1)  # faulthandler: every thread's stack
            relay.wait_output(written, _DUMP_WAIT)
        with contextlib.suppress(ValueError, OSError):  # ValueError: closed by close() meanwhile
            worker.process.kill()
        with contextlib.suppress(OSError):  # wakes its reader even if another process holds the peer
            worker.sock.shutdown(socket.SHUT_RDWR)
        tail = worker.stderr_tail()
        self._retire(worker, _calls(worker, pending))
        for request in pending.values():
            summary = (
                f"{worker.name()} sent nothing, not even a heartbeat, for {silent:.1f} s (liveness_timeout "
                f"{self._liveness_timeout} s) while running request {request.id}; it was killed"
            )
            _fail(request, WorkerUnresponsive(exit_report(summary, tail)))

    def _restart(self, slot: _Slot) -> None:
        """Start a new worker for ``slot``, retrying with backoff (0.5 s doubling to 30 s)."""
        delay = 0.0
        while not self._closing:
            if delay:
                with self._cond:
                    self._cond.wait_for(lambda: self._closing, delay)
                if self._closing:
                    break
            worker = self._start_replacement(slot)
            if worker is None:
                delay = min(max(delay * 2, 0.5), 30.0)
                continue
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
            slot.cause = "restarting"
            self._cond.notify_all()

    def _start_replacement(self, slot: _Slot) -> _Worker | None:
        """A new worker for ``slot`` that reported Ready; None if it failed (it is killed)."""
        try:
            worker = self._spawn(slot)
        except Exception:
            return None
        with self._cond:
            slot.starting = worker  # close() kills it rather than wait for its start
            closing = self._closing
        try:
            if closing:
                raise ServingStopped("the pool is closing")
            self._await_ready(worker, time.monotonic() + self._start_timeout)
        except Exception:
            _kill(worker)
            return None
        finally:
            with self._cond:
                slot.starting = None
        return worker

    # --- routing and calls --------------------------------------------------------------------

    def _pick(self, request: Request) -> _Worker | None:
        """The ready worker with the least (in_flight + 1) / weight; the start rotates for ties.
        Raises ServingStopped (tagged with the request's id) once the pool is closing."""
        if self._closing:
            raise refuse(request, ServingStopped("the pool is closed"))
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

    def _submit(self, input: object, stream: bool, deadline: float | None) -> Request:
        """Send one call to a ready worker (waiting for one if none is); its request."""
        reap(self._orphans)
        payload = encode_payload(input)
        request = Request(1, deadline)
        with self._cond:
            while (worker := self._pick(request)) is None:
                if not self._cond.wait(self._wait_limit(request)):
                    raise self._no_worker(request)
            _register(worker, request)
        _send_call(worker, request, payload, stream)
        return request

    async def _submit_async(self, input: object, stream: bool, deadline: float | None) -> Request:
        """``_submit`` for asyncio or trio: waits for a ready worker without blocking the loop."""
        reap(self._orphans)
        payload = encode_payload(input)
        request = Request(1, deadline)
        while True:
            with self._cond:
                worker = self._pick(request)
                if worker is not None:
                    _register(worker, request)
                    break
            if self._wait_limit(request) <= 0:
                raise self._no_worker(request)
            await anyio.sleep(_POLL)
        _send_call(worker, request, payload, stream)
        return request

    # --- observation --------------------------------------------------------------------------

    def health(self) -> list[WorkerHealth]:
        """One `WorkerHealth` per worker slot (no round trip to the workers)."""
        reap(self._orphans)
        with self._cond:
            return [self._health(slot) for slot in self._slots]

    def _consumer(self) -> WireConsumer:
        return WireConsumer()

    def _health(self, slot: _Slot) -> WorkerHealth:
        worker = slot.worker
        if worker is None:
            now = time.time()
            return WorkerHealth(slot.index, None, "starting", False, 0, now, now, slot.restarts)
        state = slot.cause if slot.restarting else worker.state
        alive = worker.state == "ready" and worker.process.is_alive()
        return WorkerHealth(
            slot.index, worker.pid, state, alive, len(worker.pending), worker.last_progress,
            worker.last_heartbeat, slot.restarts,
        )

    def pool_stats(self) -> PoolStats:
        """Ask every ready worker for its serving stats (5 s each at most): the sum and each."""
        reap(self._orphans)
        queries = []
        with self._cond:
            for slot in self._slots:
                worker = slot.worker
                query = None
                if worker is not None and worker.state == "ready":
                    query = Request(1, None)
                    worker.pending[query.id] = query
                    worker.queries.add(query.id)
                queries.append((slot, worker, query))
        for _, worker, query in queries:
            if query is not None and worker is not None:  # a query is only made for a worker
                with contextlib.suppress(OSError):
                    worker.send(StatsQuery(query.id))
        deadline = time.monotonic() + _STATS_TIMEOUT
        per_worker = [self._collect(*q, deadline) for q in queries]
        with self._cond:
            retired = self._retired
        live = [w.serving for w in per_worker if w.serving is not None]
        return PoolStats(sum_stats([retired, *live]), tuple(per_worker))

    def _collect(self, slot: _Slot, worker: _Worker | None, query: Request | None, deadline: float) -> WorkerStats:
        serving = None
        if worker is not None and query is not None:
            try:
                serving = ServingStats(**query.channel.get(max(deadline - time.monotonic(), 0.0)))
                worker.last_stats = serving
            except (TimeoutError, ServingError):
                with self._cond:
                    worker.pending.pop(query.id, None)
            worker.queries.discard(query.id)
        pid = worker.pid if worker is not None else None
        in_flight = len(worker.pending) if worker is not None else 0
        return WorkerStats(slot.index, pid, in_flight, slot.restarts, serving)


def _calls(worker: _Worker, pending: dict[int, Request]) -> int:
    """How many of a worker's pending requests are calls (not stats queries)."""
    return sum(1 for request_id in pending if request_id not in worker.queries)


def _register(worker: _Worker, request: Request) -> None:
    """Route ``request`` to ``worker`` (pool lock held); it is sent outside the lock."""
    request.owner = worker
    worker.pending[request.id] = request


def _send_call(worker: _Worker, request: Request, payload: msgspec.Raw, stream: bool) -> None:
    remaining = request.remaining()
    deadline = None if remaining is None else max(remaining, _MIN_DEADLINE)
    with contextlib.suppress(OSError):  # the worker died; its reader fails the request
        worker.send(Call(request.id, stream, payload, deadline))


def _answer(request: Request, message: Result | End | Failed | StatsReply, where: str) -> None:
    """Finish ``request`` with the worker's last message for it."""
    if isinstance(message, Failed):
        _fail(request, rebuild_error(message.error, where))
        return
    if isinstance(message, Result):
        request.channel.put(message.payload)
    elif isinstance(message, StatsReply):
        request.channel.put(message.stats)
    request.channel.close()


def _fail(request: Request, error: Exception) -> None:
    """Fail ``request``; a ``ServingError`` gets its id (not the id the worker's request had)."""
    if isinstance(error, ServingError):
        error.request_id = request.id
    request.fail(error)





_WATCHED = ("ready", "closing")  # the states in which a worker must keep sending heartbeats


def _liveness(liveness_timeout: float | None, heartbeat_interval: float | None) -> tuple[float | None, float]:
    """Checked (liveness_timeout, heartbeat_interval), the interval defaulted."""
    for name, value in (("liveness_timeout", liveness_timeout), ("heartbeat_interval", heartbeat_interval)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
        ):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
    if heartbeat_interval is None:
        heartbeat_interval = _HEARTBEAT if liveness_timeout is None else min(_HEARTBEAT, liveness_timeout / 4)
    if liveness_timeout is not None and heartbeat_interval >= liveness_timeout:
        raise ValueError(
            f"heartbeat_interval ({heartbeat_interval}) must be shorter than liveness_timeout "
            f"({liveness_timeout}); a quarter of it or less leaves room for late heartbeats"
        )
    return (None if liveness_timeout is None else float(liveness_timeout)), float(heartbeat_interval)


def _has_unread(sock: socket.socket) -> bool:
    """Whether a worker's connection has bytes this process has not read yet (or has ended)."""
    fd = sock.fileno()
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return False


def _is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger), so it cannot dump its stacks now;
    False where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


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
    """Kill a worker that holds no calls, reap it and release it (disposed of when no reader
    thread was ever started for it)."""
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(5.0)
    if worker.reader is None:
        worker.dispose()
    else:
        worker.release()


def _finish(worker: _Worker, deadline: float) -> None:
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
