"""`RayServingPool`: the client contract over Ray actors, one started Serving per actor.

The caller side mirrors the process pool (``serving._pool._pool``): requests are ``Request``s
read through the same ``Stream`` / ``AsyncStream`` classes, routed to the ready actor with the
least outstanding requests, with deadlines enforced in the caller. Ray carries the calls: one
actor task per request (``ServingActor.call``, or the streaming generator
``ServingActor.stream``), awaited by one asyncio loop thread per pool (the pump) that puts the
answers on the request's channel. A caller that leaves withdraws the request: the pump stops
waiting and the actor's ``cancel`` cancels the call's task there, so its serving drops the rows.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import ray
import ray.exceptions

from .._errors import (
    RemoteError,
    RequestCancelled,
    ServingError,
    ServingStopped,
    WorkerCrashed,
)
from .._options import ProcessOptions
from .._pool._base import PoolClient, refuse
from .._pool._pool import _weights
from .._pool._stats import PoolStats, WorkerHealth, WorkerStats, sum_stats
from .._pool._worker import Factory, resolve_factory
from .._request import Request, reap
from ._actor import ServingActor

__all__ = ["RayServingPool"]

_STATS_TIMEOUT = 5.0  # seconds an actor has to answer stats()
_POLL = 0.02  # seconds between checks while an async caller waits for a ready actor
_MIN_DEADLINE = 0.001  # the actor's serving refuses a deadline <= 0; the caller enforces the real one
_ACTOR_DEFAULTS = {"max_restarts": -1, "max_task_retries": 0, "max_concurrency": 1000}
_CRASHES = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)

_remote_class: Any = None
_RAY_LOCK = threading.Lock()
_ray_users: int | None = 0  # pools using the Ray connection that a pool of this process started (None: not ours)


def _join_ray() -> bool:
    """Use this process's Ray connection, starting one (``ray.init()``) if there is none. True
    when the connection is one that a pool started (it is shut down when its last pool closes)."""
    global _ray_users
    with _RAY_LOCK:
        if not ray.is_initialized():
            ray.init()
            _ray_users = 0
        elif _ray_users is None or _ray_users == 0:
            _ray_users = None  # the caller's own connection (or one a closed pool left): never ours
            return False
        _ray_users += 1
        return True


def _leave_ray() -> None:
    global _ray_users
    with _RAY_LOCK:
        if _ray_users:
            _ray_users -= 1
            if _ray_users == 0:
                ray.shutdown()


async def _cancel_pumps() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _actor_class() -> Any:
    global _remote_class
    if _remote_class is None:
        _remote_class = ray.remote(ServingActor)
    return _remote_class


class _Items:
    """The ``Consumer`` of a Ray pool request: each channel message is one item (a stream item,
    or a call's result), already deserialized by Ray."""

    live = True

    def on_message(self, message: Any) -> list[Any]:
        return [message]

    def finish(self) -> list[Any]:
        return []

    def result(self, items: list[Any]) -> Any:
        return items[0]


class _Slot:
    """One actor (Ray restarts it in place) and the requests routed to it; the ``Owner`` (see
    ``serving._request``) of those requests."""

    def __init__(self, index: int, weight: float, actor: Any, name: str, lock: threading.Condition,
                 orphans: deque[Request], loop: asyncio.AbstractEventLoop) -> None:
        self.index, self.weight, self.actor, self.name = index, weight, actor, name
        self.pid: int | None = None
        self.state = "starting"
        self.restarts = 0
        self.pending: dict[int, Request] = {}  # by request id, also the call id in the actor
        self.pumps: dict[int, concurrent.futures.Future[None]] = {}
        self.orphans = orphans
        self.last_progress = time.time()
        self._lock, self._loop = lock, loop

    def withdraw(self, request: Request, error: BaseException) -> None:
        """The caller left or its deadline passed: stop waiting for the call and cancel it in the
        actor (nothing is sent for a call that already finished)."""
        with self._lock:
            held = self.pending.pop(request.id, None) is not None
            pump = self.pumps.pop(request.id, None)
        if pump is not None:
            pump.cancel()
        if held:
            with contextlib.suppress(Exception):  # the actor is gone: nothing left to cancel
                self.actor.cancel.remote(request.id)

    def stop_rows(self, request: Request, indices: list[int]) -> None:
        """Raises TypeError: the transducer runs in the actor, whose serving stops its rows."""
        raise TypeError("a Ray pool request cannot stop rows from the caller; the actor's serving does")

    def describe(self) -> str:
        return f"Ray pool actor {self.index} ({self.name}, pid {self.pid})"


class RayServingPool(PoolClient):
    """``workers`` Ray actors, each with its own Serving started in process mode.

    Implements the client contract (``Client``): ``run`` / ``run_async`` / ``stream`` /
    ``stream_async`` / ``stats`` / ``close`` / ``aclose``, with the semantics of the process pool
    (``ServingPool``); ``health()`` and ``pool_stats()`` report per actor.

    factory: an import path ``"package.module:function"`` or a callable returning a ``Serving``
      (serialized with cloudpickle: a lambda or a function of ``__main__`` works); each actor
      calls it once. The caller's ``sys.path`` entries that exist on the
      actor's host are added there; on other hosts ship the code with ``runtime_env``.
    ray_actor_options: passed to ``.options()`` of every actor: placement (``num_cpus``,
      ``num_gpus=1`` per CUDA GPU, ``resources={"mlx": 1}`` per Apple-silicon host), ``runtime_env``,
      ``max_restarts`` (default -1: always restart a dead actor), ...
    weights: routing weights, as for the process pool.
    start_timeout: seconds the actors have to start (and a restarted one to come back); also the
      longest a request waits for a ready actor.
    process_options: ``Serving.start`` options for every actor (``batch_size``, ...).

    Joins the Ray cluster this process already initialized (``ray.init(address=...)``), else
    calls ``ray.init()`` (which joins ``RAY_ADDRESS`` if set, or starts a local cluster), shared by
    the pools opened meanwhile and shut down (``ray.shutdown()``) when the last of them closes; a
    connection the caller made is never shut down.
    """

    def __init__(
        self,
        factory: Factory,
        workers: int = 1,
        *,
        ray_actor_options: dict[str, Any] | None = None,
        weights: Sequence[float] | None = None,
        start_timeout: float = 120.0,
        **process_options: object,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        factory_bytes = _pickle_factory(factory)
        checked = ProcessOptions().merge(**{k: v for k, v in process_options.items() if k != "name"})
        self._process_options = process_options
        self._start_timeout = start_timeout
        self._shutdown_timeout = float(checked.shutdown_timeout)
        options = {**_ACTOR_DEFAULTS, **(ray_actor_options or {})}
        weights_ = _weights(weights, workers)
        self._cond = threading.Condition()
        self._orphans: deque[Request] = deque()
        self._turn = 0
        self._closing = False
        self._closed = threading.Event()
        self._watchers: list[threading.Thread] = []
        self._shares_ray = _join_ray()
        self._loop = asyncio.new_event_loop()
        self._pump_thread = threading.Thread(target=self._loop.run_forever, name="ray-pool-pump", daemon=True)
        self._pump_thread.start()
        tag = uuid.uuid4().hex[:8]
        self._slots: list[_Slot] = []
        try:
            for i, weight in enumerate(weights_):
                name = f"mlx-serving-pool-{tag}-{i}"
                actor = _actor_class().options(name=name, **options).remote(
                    factory_bytes, process_options, list(sys.path)
                )
                self._slots.append(_Slot(i, weight, actor, name, self._cond, self._orphans, self._loop))
            self._await_ready()
        except BaseException:
            self._teardown()
            raise

    # --- lifecycle ----------------------------------------------------------------------------

    def _await_ready(self) -> None:
        refs = [slot.actor.ready.remote() for slot in self._slots]
        try:
            pids = ray.get(refs, timeout=self._start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the Ray pool actors did not start within {self._start_timeout} s") from None
        except ray.exceptions.RayTaskError as exc:  # the factory or Serving.start raised
            raise _start_error(exc) from None
        except _CRASHES as exc:
            raise WorkerCrashed(f"a Ray pool actor died while starting: {exc}") from None
        with self._cond:
            for slot, pid in zip(self._slots, pids):
                slot.pid, slot.state = pid, "ready"
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (up to ``timeout`` s, default the
        ``shutdown_timeout`` process option or 30), stop every actor's serving and kill the
        actors (no restart). Requests still unfinished then fail with ``ServingStopped``.
        Idempotent; requests made after it raise ``ServingStopped``."""
        timeout = self._shutdown_timeout if timeout is None else timeout
        with self._cond:
            first = not self._closing
            self._closing = True
            self._cond.notify_all()
            live = [s for s in self._slots if s.state == "ready"]
            for slot in live:
                slot.state = "closing"
        if not first:
            self._closed.wait()
            return
        refs = [slot.actor.shutdown.remote(timeout) for slot in live]
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=timeout + 5.0)
        with self._cond:
            pumps = [pump for slot in self._slots for pump in slot.pumps.values()]
        concurrent.futures.wait(pumps, timeout=5.0)  # answers already sent are delivered
        self._teardown()
        self._closed.set()

    def _teardown(self) -> None:
        """Fail what is left with ServingStopped, kill the actors, stop the pump and the
        watchers, and shut Ray down if the pool started it."""
        with self._cond:
            self._closing = True
            left = [(slot, request) for slot in self._slots for request in slot.pending.values()]
            for slot in self._slots:
                slot.state = "stopped"
            self._cond.notify_all()
        for slot, request in left:
            _fail(request, ServingStopped(f"{slot.describe()} stopped before request {request.id} finished"))
        for slot in self._slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        for thread in list(self._watchers):
            thread.join()
        with contextlib.suppress(Exception):  # pumps still waiting (an actor that never answered)
            asyncio.run_coroutine_threadsafe(_cancel_pumps(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pump_thread.join()
        self._loop.close()
        if self._shares_ray:
            _leave_ray()

    # --- answers ------------------------------------------------------------------------------

    async def _pump(self, slot: _Slot, request: Request, ref: Any, stream: bool) -> None:
        """Put the actor's answers for ``request`` on its channel; runs on the pump loop."""
        try:
            if stream:
                async for item_ref in ref:
                    item = await item_ref
                    request.channel.put(item)
                    slot.last_progress = time.time()
            else:
                request.channel.put(await ref)
            with self._cond:
                held = slot.pending.pop(request.id, None) is not None
                slot.pumps.pop(request.id, None)
            slot.last_progress = time.time()
            if held:
                request.channel.close()
        except asyncio.CancelledError:
            pass  # the caller withdrew the request
        except Exception as exc:
            with self._cond:
                slot.pending.pop(request.id, None)
                slot.pumps.pop(request.id, None)
            slot.last_progress = time.time()
            if isinstance(exc, _CRASHES):
                self._lost(slot)
            _fail(request, self._error(slot, request, exc))

    def _error(self, slot: _Slot, request: Request, exc: Exception) -> Exception:
        """The caller-side error for a failed actor task."""
        if isinstance(exc, _CRASHES):
            if self._closing:
                return ServingStopped(f"{slot.describe()} stopped before request {request.id} finished")
            return WorkerCrashed(f"{slot.describe()} died while running request {request.id}: {exc}")
        if isinstance(exc, ray.exceptions.TaskCancelledError):
            return RequestCancelled(f"request {request.id} was cancelled")
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = exc.cause
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                return cause
            error = RemoteError(f"{slot.describe()} raised: {exc}")
            error.type_name = type(cause).__qualname__ if cause is not None else ""
            error.message = str(cause) if cause is not None else str(exc)
            error.remote_traceback = getattr(exc, "traceback_str", "")
            return error
        if isinstance(exc, ray.exceptions.RayError):
            return WorkerCrashed(f"{slot.describe()} failed request {request.id}: {exc!r}")
        return exc

    def _lost(self, slot: _Slot) -> None:
        """The slot's actor died: route around it until Ray has restarted it."""
        with self._cond:
            if slot.state != "ready" or self._closing:
                return
            slot.state = "restarting"
            thread = threading.Thread(target=self._watch, args=(slot,), name=f"ray-pool-restart-{slot.index}",
                                      daemon=True)
            self._watchers.append(thread)
        thread.start()

    def _watch(self, slot: _Slot) -> None:
        """Ask the slot's actor for its pid until Ray restarted it (up to ``start_timeout``);
        then route to it again. An actor that does not come back is marked ``dead``."""
        end = time.monotonic() + self._start_timeout
        while not self._closing and time.monotonic() < end:
            try:
                pid = ray.get(slot.actor.ready.remote(), timeout=min(1.0, max(end - time.monotonic(), 0.01)))
            except (ray.exceptions.GetTimeoutError, *_CRASHES):
                time.sleep(0.05)
                continue
            except Exception:  # its factory failed this time: do not restart it again
                with contextlib.suppress(Exception):
                    ray.kill(slot.actor, no_restart=True)
                break
            with self._cond:
                if slot.state == "restarting":
                    slot.pid, slot.state = pid, "ready"
                    slot.restarts += 1
                    self._cond.notify_all()
            return
        with self._cond:
            if slot.state == "restarting":
                slot.state = "dead"
            self._cond.notify_all()

    # --- routing and calls --------------------------------------------------------------------

    def _pick(self, request: Request) -> _Slot | None:
        """The ready actor with the least (in_flight + 1) / weight; ties rotate. Raises
        ServingStopped once closing, WorkerCrashed when every actor is dead."""
        if self._closing:
            raise refuse(request, ServingStopped("the pool is closed"))
        best, best_score = None, math.inf
        count = len(self._slots)
        self._turn = (self._turn + 1) % count
        for offset in range(count):
            slot = self._slots[(self._turn + offset) % count]
            if slot.state == "ready":
                score = (len(slot.pending) + 1) / slot.weight
                if score < best_score:
                    best, best_score = slot, score
        if best is None and all(slot.state == "dead" for slot in self._slots):
            raise refuse(request, WorkerCrashed("every Ray pool actor died and was not restarted"))
        return best

    def _send(self, slot: _Slot, request: Request, input: Any, stream: bool) -> None:
        """Start the actor task and its pump (the request is registered on ``slot``)."""
        remaining = request.remaining()
        deadline = None if remaining is None else max(remaining, _MIN_DEADLINE)
        try:
            if stream:
                ref = slot.actor.stream.options(num_returns="streaming").remote(request.id, input, deadline)
            else:
                ref = slot.actor.call.remote(request.id, input, deadline)
        except Exception as exc:  # the input cannot be serialized, or the actor is gone
            with self._cond:
                slot.pending.pop(request.id, None)
            error = self._error(slot, request, exc) if isinstance(exc, ray.exceptions.RayError) else exc
            _fail(request, error)
            raise error from None
        with self._cond:
            if request.id in slot.pending:
                pump = asyncio.run_coroutine_threadsafe(self._pump(slot, request, ref, stream), self._loop)
                slot.pumps[request.id] = pump
                return
        with contextlib.suppress(Exception):  # withdrawn meanwhile
            slot.actor.cancel.remote(request.id)

    def _submit(self, input: Any, stream: bool, deadline: float | None) -> Request:
        reap(self._orphans)
        request = Request(1, deadline)
        with self._cond:
            while (slot := self._pick(request)) is None:
                if not self._cond.wait(self._wait_limit(request)):
                    raise self._no_worker(request)
            _register(slot, request)
        self._send(slot, request, input, stream)
        return request

    async def _submit_async(self, input: Any, stream: bool, deadline: float | None) -> Request:
        reap(self._orphans)
        request = Request(1, deadline)
        while True:
            with self._cond:
                slot = self._pick(request)
                if slot is not None:
                    _register(slot, request)
                    break
            if self._wait_limit(request) <= 0:
                raise self._no_worker(request)
            await anyio.sleep(_POLL)
        self._send(slot, request, input, stream)
        return request

    # --- observation --------------------------------------------------------------------------

    _worker_name = "Ray pool actor"

    def _consumer(self) -> _Items:
        return _Items()

    def health(self) -> list[WorkerHealth]:
        """One ``WorkerHealth`` per actor (no round trip). ``state``: starting | ready |
        restarting (Ray is restarting it) | dead | closing | stopped; ``pid`` is the actor
        process's; ``last_heartbeat`` is its last answer (the pool sends no heartbeats: Ray
        detects dead actors)."""
        reap(self._orphans)
        with self._cond:
            return [
                WorkerHealth(s.index, s.pid, s.state, s.state == "ready", len(s.pending), s.last_progress,
                             s.last_progress, s.restarts)
                for s in self._slots
            ]

    def pool_stats(self) -> PoolStats:
        """Ask every ready actor for its serving stats (5 s at most): the sum and each."""
        reap(self._orphans)
        with self._cond:
            slots = [(s, s.actor.stats.remote() if s.state == "ready" else None) for s in self._slots]
        end = time.monotonic() + _STATS_TIMEOUT
        per_actor = []
        for slot, ref in slots:
            serving = None
            if ref is not None:
                with contextlib.suppress(Exception):
                    serving = ray.get(ref, timeout=max(end - time.monotonic(), 0.01))
            per_actor.append(WorkerStats(slot.index, slot.pid, len(slot.pending), slot.restarts, serving))
        return PoolStats(sum_stats([w.serving for w in per_actor if w.serving is not None]), tuple(per_actor))


def _register(slot: _Slot, request: Request) -> None:
    request.owner = slot
    slot.pending[request.id] = request


def _fail(request: Request, error: BaseException) -> None:
    if isinstance(error, ServingError):
        error.request_id = request.id
    request.fail(error)





def _pickle_factory(factory: Factory) -> bytes:
    """The factory as cloudpickle bytes (functions of ``__main__``, lambdas and closures travel by
    value); ValueError / TypeError for a malformed import path or an unpicklable callable."""
    if isinstance(factory, str):
        module_name, _, attribute = factory.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"factory import path must look like 'package.module:function', got {factory!r}")
    else:
        resolve_factory(factory)
    try:
        return ray.cloudpickle.dumps(factory)
    except Exception as exc:
        raise TypeError(f"factory must be an import path 'package.module:function' or a callable that "
                        f"cloudpickle can serialize: {exc!r}") from exc


def _start_error(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The factory's (or Serving.start's) exception, raised by the actor's ``ready``."""
    cause = exc.cause
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return cause
    return RemoteError(f"a Ray pool actor failed to start: {exc}")
