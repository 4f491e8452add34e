"""`ServingPool`: N workers, each running its own copy of a Serving, behind the one client
contract (``Client``: run / run_async / stream / stream_async / stats / close / aclose); how a
worker runs is its backend object's (``ProcessBackend``, ``RayBackend``: see ``_backend``)."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio

from .._client import Consumer
from .._errors import ServingStopped, WorkerCrashed
from .._options import ProcessOptions
from .._request import Request, reap
from ._backend import PoolBackend, PoolWorker, WorkerGone
from ._base import PoolClient, check_weights, fail, refuse
from ._process import ProcessBackend
from ._stats import NO_STATS, PoolStats, WorkerHealth, WorkerStats, retire, sum_stats
from ._worker import Factory

__all__ = ["ServingPool", "make_backend"]

_STATS_TIMEOUT = 5.0  # seconds a worker has to answer pool.stats()
_POLL = 0.02  # seconds between checks while an async caller waits for a worker to be ready
_PROCESS_OPTIONS = ("worker_env", "liveness_timeout", "heartbeat_interval")  # ProcessBackend's
_RAY_OPTIONS = ("ray_actor_options",)  # RayBackend's


class _Slot:
    def __init__(self, index: int, weight: float) -> None:
        self.index, self.weight = index, weight
        self.worker: PoolWorker | None = None
        self.restarts = 0
        self.restarting = False
        self.dead = False  # its backend gave up restarting it (WorkerGone)
        self.cause = "restarting"  # what health() calls the slot while restarting ("unresponsive")
        self.starting: PoolWorker | None = None  # a replacement that has not reported ready yet


def make_backend(backend: str | PoolBackend, options: dict[str, Any]) -> PoolBackend:
    """``ServingPool``'s ``backend`` argument as a backend object: an object as is, ``"process"``
    -> ``ProcessBackend(**options)``, ``"ray"`` -> ``RayBackend(**options)`` (``ray`` is imported
    only then). ``options`` are the backend's keyword arguments given to ``ServingPool``.
    Raises ValueError for another string, TypeError for an option the backend does not take."""
    process = {k: options[k] for k in _PROCESS_OPTIONS if k in options}
    ray = {k: options[k] for k in _RAY_OPTIONS if k in options}
    if not isinstance(backend, str):
        if options:
            raise TypeError(f"{', '.join(sorted(options))}: give them to the backend object, not ServingPool")
        return backend
    if backend == "process":
        if ray:
            raise TypeError("ray_actor_options needs backend='ray'")
        return ProcessBackend(**process)
    if backend == "ray":
        if process:
            raise TypeError(f"{', '.join(sorted(process))}: options of the process backend only (Ray "
                            "detects dead actors itself; place actors with ray_actor_options)")
        from ..ray import RayBackend

        return RayBackend(**ray)
    raise ValueError(f"backend must be 'process', 'ray' or a backend object, got {backend!r}")


class ServingPool(PoolClient):
    """Runs ``workers`` workers, each with its own Serving started in process mode.

    Implements the client contract (``Client``): ``run`` / ``run_async`` / ``stream`` /
    ``stream_async`` / ``stats`` / ``close`` / ``aclose`` with the semantics of a
    ``ServingHandle``; ``health()`` and ``pool_stats()`` report per worker.

    ``factory`` is an import path ``"package.module:function"`` or a callable; each worker calls
    it once (in the worker) and must get a ``Serving``, which it starts with
    ``Serving.start(serving, **process_options)``.

    backend: how the workers run, an object: ``ProcessBackend(...)`` (spawned processes on this
      host, the default; its options: ``worker_env``, ``liveness_timeout``,
      ``heartbeat_interval``) or ``mlx_serving.serving.ray.RayBackend(...)`` (Ray actors; its
      option ``ray_actor_options``). The strings ``"process"`` / ``"ray"`` are a shorthand: the
      backend made with those options given here (``ServingPool(f, 2, backend="ray",
      ray_actor_options={...})`` is ``ServingPool(f, 2, backend=RayBackend({...}))``).
    weights: routing weights (positive, one per worker; default all 1.0). A request goes to the
      ready worker with the least ``(in_flight + 1) / weight``; ties rotate.
    start_timeout: seconds a worker has to build and start its serving; also the longest a
      request waits for a worker while every worker is restarting.

    Raises the worker's exception if a factory or ``Serving.start`` fails in any worker (after
    stopping every started worker), ``TimeoutError`` if one does not start in time,
    ``WorkerCrashed`` if one dies while starting, ``ValueError`` / ``TypeError`` for bad
    arguments (``TypeError`` for an option of the other backend).
    """

    def __init__(
        self,
        factory: Factory,
        workers: int = 1,
        *,
        backend: str | PoolBackend = "process",
        weights: Sequence[float] | None = None,
        start_timeout: float = 120.0,
        **options: Any,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        backend_options = {k: options.pop(k) for k in (*_PROCESS_OPTIONS, *_RAY_OPTIONS) if k in options}
        # refuse bad options here rather than in every worker (``name`` is Serving.start's own)
        checked = ProcessOptions().merge(**{k: v for k, v in options.items() if k != "name"})
        self._slots = [_Slot(i, w) for i, w in enumerate(check_weights(weights, workers))]
        self._backend = make_backend(backend, backend_options)
        self._worker_name = self._backend.worker_name
        self._start_timeout = start_timeout
        self._shutdown_timeout = float(checked.shutdown_timeout)
        self._cond = threading.Condition()
        self._orphans: deque[Request] = deque()
        self._turn = 0
        self._closing = False
        self._retired = NO_STATS  # counts of lost workers (see retire)
        self._closed = threading.Event()
        self._restarters: list[threading.Thread] = []
        self._backend.bind(factory, workers, options, self)
        self._start_all()

    @property
    def backend(self) -> PoolBackend:
        """The backend object the workers run on."""
        return self._backend

    @property
    def closing(self) -> bool:
        """Whether ``close()`` has begun."""
        return self._closing

    # --- lifecycle ----------------------------------------------------------------------------

    def _start_all(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        started: list[PoolWorker] = []
        try:
            for slot in self._slots:
                started.append(self._backend.start(slot.index, self._cond, self._orphans))
            for worker in started:
                self._backend.await_ready(worker, deadline)
        except BaseException:
            for worker in started:
                self._backend.kill(worker)
            self._backend.close()
            raise
        for slot, worker in zip(self._slots, started):
            self._activate(slot, worker)

    def _activate(self, slot: _Slot, worker: PoolWorker) -> None:
        """Route to ``worker`` from now on."""
        worker.state = "ready"
        worker.last_progress = worker.last_heartbeat = time.time()
        with self._cond:
            slot.worker = worker
            slot.cause = "restarting"
            self._cond.notify_all()
        worker.begin()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (up to ``timeout`` s, default the
        ``shutdown_timeout`` process option or 30), then stop every worker and see it gone (a
        worker still alive 5 s after that is killed). Requests still unfinished then fail with
        ``ServingStopped``. Idempotent; requests made after it raise ``ServingStopped``."""
        timeout = self._shutdown_timeout if timeout is None else timeout
        with self._cond:
            first = not self._closing
            self._closing = True
            self._cond.notify_all()
            workers = [s.worker for s in self._slots if s.worker is not None]
            live = [w for w in workers if w.state == "ready"]
            for worker in live:
                worker.state = "closing"
        if not first:
            self._closed.wait()
            return
        with self._cond:
            starting = [s.starting for s in self._slots if s.starting is not None]
        for worker in starting:
            self._backend.kill(worker)
        for thread in list(self._restarters):
            thread.join()
        self._backend.stop(workers, live, timeout)
        self._stop_left(workers)
        self._backend.close()
        self._closed.set()

    def _stop_left(self, workers: list[PoolWorker]) -> None:
        """Mark the workers stopped; fail the calls they still hold with ServingStopped."""
        for worker in workers:
            detached = self.detach(worker, "stopped", "restarting")
            for request in detached[1].values() if detached is not None else ():
                fail(request, ServingStopped(f"{worker.name()} stopped before request {request.id} finished"))

    # --- what the backend reports (PoolEvents) ------------------------------------------------

    def detach(self, worker: PoolWorker, state: str, cause: str,
               expect: tuple[str, ...] | None = None) -> tuple[str, dict[int, Request]] | None:
        """The worker is lost: set its ``state``, take its calls, and start its slot's
        replacement (``cause`` shown meanwhile) unless closing or already replaced. Returns
        (its previous state, its calls); None when its state is not in ``expect``."""
        with self._cond:
            previous = worker.state
            if expect is not None and previous not in expect:
                return None
            worker.state = state
            pending, worker.pending = worker.pending, {}
            slot = self._slots[worker.index]
            if previous not in ("unresponsive", "stopped") and slot.worker is worker and not self._closing:
                slot.cause = cause
                self._replace(slot)
            self._cond.notify_all()
        return previous, pending

    def retire(self, worker: PoolWorker, crashed: int) -> None:
        """Keep a lost worker's counts in the pool's totals (``retire``), ``crashed`` calls failed."""
        with self._cond:
            self._retired = retire(self._retired, worker.last_stats, crashed)
            worker.last_stats = None  # folded once: a worker may be reported lost twice

    def watched(self, states: tuple[str, ...]) -> list[PoolWorker]:
        """The slots' current workers whose state is in ``states``."""
        with self._cond:
            return [s.worker for s in self._slots if s.worker is not None and s.worker.state in states]

    # --- restarts -----------------------------------------------------------------------------

    def _replace(self, slot: _Slot) -> None:
        """Start the thread that replaces the slot's worker (pool lock held)."""
        slot.restarting = True
        thread = threading.Thread(
            target=self._restart, args=(slot,), name=f"serving-pool-restart-{slot.index}", daemon=True
        )
        thread.start()
        self._restarters.append(thread)

    def _restart(self, slot: _Slot) -> None:
        """Start a new worker for ``slot``, retrying with backoff (0.5 s doubling to 30 s) until
        one is ready, the pool closes, or the backend gives up (WorkerGone: the slot is dead)."""
        delay = 0.0
        while not self._closing and not slot.dead:
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
            self._backend.kill(worker)
            break
        with self._cond:
            slot.restarting = False
            slot.cause = "restarting"
            self._cond.notify_all()

    def _start_replacement(self, slot: _Slot) -> PoolWorker | None:
        """A new worker for ``slot`` that is ready; None if it failed (it is killed)."""
        try:
            worker = self._backend.start(slot.index, self._cond, self._orphans)
        except Exception:
            return None
        with self._cond:
            slot.starting = worker  # close() kills it rather than wait for its start
            closing = self._closing
        try:
            if closing:
                raise ServingStopped("the pool is closing")
            self._backend.await_ready(worker, time.monotonic() + self._start_timeout)
        except Exception as exc:
            slot.dead = isinstance(exc, WorkerGone) and not self._closing
            self._backend.kill(worker)
            return None
        finally:
            with self._cond:
                slot.starting = None
        return worker

    # --- routing and calls --------------------------------------------------------------------

    def _pick(self, request: Request) -> PoolWorker | None:
        """The ready worker with the least (in_flight + 1) / weight; the start rotates for ties.
        Raises ServingStopped (tagged with the request's id) once the pool is closing,
        WorkerCrashed when every slot is dead."""
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
        if best is None and all(slot.dead for slot in self._slots):
            raise refuse(request, WorkerCrashed(f"every {self._worker_name} died and was not restarted"))
        return best

    def _submit(self, input: object, stream: bool, deadline: float | None) -> Request:
        """Send one call to a ready worker (waiting for one if none is); its request."""
        reap(self._orphans)
        payload = self._backend.encode(input)
        request = Request(1, deadline)
        with self._cond:
            while (worker := self._pick(request)) is None:
                if not self._cond.wait(self._wait_limit(request)):
                    raise self._no_worker(request)
            _register(worker, request)
        self._send(worker, request, payload, stream)
        return request

    async def _submit_async(self, input: object, stream: bool, deadline: float | None) -> Request:
        """``_submit`` for asyncio or trio: waits for a ready worker without blocking the loop."""
        reap(self._orphans)
        payload = self._backend.encode(input)
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
        self._send(worker, request, payload, stream)
        return request

    def _send(self, worker: PoolWorker, request: Request, payload: object, stream: bool) -> None:
        """Send a registered call; what makes it unsendable fails the request and is raised."""
        try:
            worker.send(request, payload, stream)
        except Exception as exc:
            with self._cond:
                worker.pending.pop(request.id, None)
            fail(request, exc)
            raise

    def _consumer(self) -> Consumer[Any]:
        return self._backend.consumer()

    # --- observation --------------------------------------------------------------------------

    def health(self) -> list[WorkerHealth]:
        """One ``WorkerHealth`` per worker slot (no round trip to the workers). ``state``:
        starting | ready | restarting | unresponsive (being replaced after going silent) | dead
        (its backend gave up restarting it) | closing | stopped."""
        reap(self._orphans)
        with self._cond:
            return [self._health(slot) for slot in self._slots]

    def _health(self, slot: _Slot) -> WorkerHealth:
        worker = slot.worker
        if worker is None:
            now = time.time()
            return WorkerHealth(slot.index, None, "starting", False, 0, now, now, slot.restarts)
        state = "dead" if slot.dead else slot.cause if slot.restarting else worker.state
        alive = worker.state == "ready" and worker.is_alive()
        return WorkerHealth(
            slot.index, worker.pid, state, alive, len(worker.pending), worker.last_progress,
            worker.last_heartbeat, slot.restarts,
        )

    def pool_stats(self) -> PoolStats:
        """Ask every ready worker for its serving stats (5 s at most): the sum and each."""
        reap(self._orphans)
        with self._cond:
            ready = [(slot, slot.worker) for slot in self._slots]
        asked = [(slot, worker, worker.ask_stats() if worker is not None and worker.state == "ready" else None)
                 for slot, worker in ready]
        deadline = time.monotonic() + _STATS_TIMEOUT
        per_worker = []
        for slot, worker, answer in asked:
            serving = None if answer is None else answer(max(deadline - time.monotonic(), 0.0))
            if worker is not None and serving is not None:
                worker.last_stats = serving
            pid = worker.pid if worker is not None else None
            in_flight = len(worker.pending) if worker is not None else 0
            per_worker.append(WorkerStats(slot.index, pid, in_flight, slot.restarts, serving))
        with self._cond:
            retired = self._retired
        live = [w.serving for w in per_worker if w.serving is not None]
        return PoolStats(sum_stats([retired, *live]), tuple(per_worker))


def _register(worker: PoolWorker, request: Request) -> None:
    """Route ``request`` to ``worker`` (pool lock held); it is sent outside the lock."""
    request.owner = worker
    worker.pending[request.id] = request
