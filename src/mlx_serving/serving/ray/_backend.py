"""``RayBackend``: a ``ServingPool``'s workers as Ray actors, one started Serving per actor.

The pool (``serving._pool._pool``) routes, waits and reports as for processes; this backend
starts the actors (``ServingActor``), waits for them, carries the calls (``ActorWorker``: one
actor task per request, awaited on one asyncio loop thread per pool, the pump), follows Ray's
restarts of a dead actor, and stops them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any

import ray
import ray.exceptions

from .._errors import WorkerCrashed
from .._pool._backend import PoolEvents, PoolWorker, WorkerGone
from .._pool._base import check_factory_path
from .._pool._worker import Factory, resolve_factory
from .._request import Request
from ._actor import ServingActor
from ._actor_worker import CRASHES, ActorWorker, Items, cause_of

__all__ = ["RayBackend"]

_ACTOR_DEFAULTS = {"max_restarts": -1, "max_task_retries": 0, "max_concurrency": 1000}

_remote_class: Any = None
_RAY_LOCK = threading.Lock()
_ray_users: int | None = 0  # pools using the Ray connection that a pool of this process started (None: not ours)


class RayBackend:
    """A ``ServingPool``'s workers as Ray actors (``ServingPool(factory, N, backend=RayBackend())``,
    or ``backend="ray"``), with the semantics of the process backend; ``ray`` is imported only
    by ``mlx_serving.serving.ray``.

    ray_actor_options: passed to ``.options()`` of every actor: placement (``num_cpus``,
      ``num_gpus=1`` per CUDA GPU, ``resources={"mlx": 1}`` per Apple-silicon host),
      ``runtime_env``, ``max_restarts`` (default -1: always restart a dead actor), ...

    The factory is serialized with cloudpickle (a lambda or a function of ``__main__`` works);
    the caller's ``sys.path`` entries that exist on the actor's host are added there; on other
    hosts ship the code with ``runtime_env``. A dead actor's calls fail with ``WorkerCrashed``;
    Ray restarts it in place and the pool routes to it again once it answers (within
    ``start_timeout``, else its slot is ``dead``).

    The pool joins the Ray cluster this process already initialized (``ray.init(address=...)``),
    else calls ``ray.init()`` (which joins ``RAY_ADDRESS`` if set, or starts a local cluster),
    shared by the pools opened meanwhile and shut down (``ray.shutdown()``) when the last of them
    closes; a connection the caller made is never shut down.
    """

    worker_name = "Ray pool actor"

    def __init__(self, ray_actor_options: dict[str, Any] | None = None) -> None:
        self._options = {**_ACTOR_DEFAULTS, **(ray_actor_options or {})}
        self._tag = uuid.uuid4().hex[:8]
        self._actors: dict[int, Any] = {}
        self._factory = b""
        self._process_options: dict[str, Any] = {}
        self._events: PoolEvents | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the pump's, made by bind()
        self._pump_thread: threading.Thread | None = None
        self._shares_ray = False
        self._closed = False

    @property
    def actor_names(self) -> list[str]:
        """The names of the pool's actors (``ray.get_actor(name)``), by slot."""
        return [self._name(index) for index in sorted(self._actors)]

    def bind(self, factory: Factory, workers: int, process_options: dict[str, Any], events: PoolEvents) -> None:
        """Check and serialize the factory (ValueError / TypeError); join Ray; start the pump."""
        if self._events is not None:
            raise RuntimeError("this RayBackend serves a pool already; make one per pool")
        self._factory = _pickle_factory(factory)
        self._process_options, self._events = process_options, events
        self._shares_ray = _join_ray()
        self._loop = asyncio.new_event_loop()
        self._pump_thread = threading.Thread(target=self._loop.run_forever, name="ray-pool-pump", daemon=True)
        self._pump_thread.start()

    def consumer(self) -> Items:
        return Items()

    def encode(self, input: object) -> object:
        """The input as is (Ray serializes it when the call is sent)."""
        return input

    # --- starting -----------------------------------------------------------------------------

    def start(self, index: int, lock: threading.Condition, orphans: deque[Request]) -> ActorWorker:
        """Create slot ``index``'s actor; for a slot that has one, a new incarnation of it (Ray
        restarts it in place)."""
        assert self._events is not None and self._loop is not None, "bind() first"
        restarted = index in self._actors
        if not restarted:
            self._actors[index] = _actor_class().options(name=self._name(index), **self._options).remote(
                self._factory, self._process_options, list(sys.path)
            )
        return ActorWorker(index, self._actors[index], self._name(index), restarted, lock, orphans, self._loop,
                           self._events)

    def await_ready(self, worker: PoolWorker, deadline: float) -> None:
        """Wait for the actor to answer ``ready`` (its pid). A first start raises the factory's
        error, TimeoutError or WorkerCrashed; a restarted actor is asked until ``deadline`` and
        raises WorkerGone if it does not come back."""
        assert isinstance(worker, ActorWorker)
        if worker.restarted:
            worker.pid = self._await_restart(worker, deadline)
            return
        try:
            worker.pid = ray.get(worker.actor.ready.remote(), timeout=max(deadline - time.monotonic(), 0.01))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{worker.name()} did not start in time (start_timeout)") from None
        except ray.exceptions.RayTaskError as exc:  # the factory or Serving.start raised
            raise cause_of(exc, f"a Ray pool actor failed to start: {exc}") from None
        except CRASHES as exc:
            raise WorkerCrashed(f"a Ray pool actor died while starting: {exc}") from None

    def _await_restart(self, worker: ActorWorker, deadline: float) -> int:
        """The restarted actor's pid, once Ray restarted it; WorkerGone if it is not back by
        ``deadline`` or its factory failed this time (the pool then kills it)."""
        assert self._events is not None
        while not self._events.closing and time.monotonic() < deadline:
            try:
                return int(ray.get(worker.actor.ready.remote(), timeout=min(1.0, max(deadline - time.monotonic(), 0.01))))
            except (ray.exceptions.GetTimeoutError, *CRASHES):
                time.sleep(0.05)
            except Exception as exc:
                raise WorkerGone(f"{worker.name()} failed to restart: {exc}") from None
        raise WorkerGone(f"{worker.name()} was not restarted within start_timeout")

    # --- stopping -----------------------------------------------------------------------------

    def kill(self, worker: PoolWorker) -> None:
        assert isinstance(worker, ActorWorker)
        with contextlib.suppress(Exception):
            ray.kill(worker.actor, no_restart=True)

    def stop(self, workers: list[PoolWorker], live: list[PoolWorker], timeout: float) -> None:
        """Have the live actors finish their calls (up to ``timeout`` s) and stop their servings;
        deliver the answers already sent; kill every actor (no restart)."""
        refs = []
        for worker in live:
            assert isinstance(worker, ActorWorker)
            with contextlib.suppress(Exception):
                refs.append(worker.actor.shutdown.remote(timeout))
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=timeout + 5.0)
        pumps = [pump for w in workers if isinstance(w, ActorWorker) for pump in w.pending_pumps()]
        concurrent.futures.wait(pumps, timeout=5.0)
        for worker in workers:
            self.kill(worker)

    def close(self) -> None:
        """Stop the pump (cancelling the waits left) and shut Ray down if the pool started it."""
        if self._closed or self._loop is None or self._pump_thread is None:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # pumps still waiting (an actor that never answered)
            asyncio.run_coroutine_threadsafe(_cancel_pumps(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._pump_thread.join()
        self._loop.close()
        if self._shares_ray:
            _leave_ray()

    def _name(self, index: int) -> str:
        return f"mlx-serving-pool-{self._tag}-{index}"


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


def _pickle_factory(factory: Factory) -> bytes:
    """The factory as cloudpickle bytes (functions of ``__main__``, lambdas and closures travel by
    value); ValueError / TypeError for a malformed import path or an unpicklable callable."""
    check_factory_path(factory)
    if not isinstance(factory, str):
        resolve_factory(factory)
    try:
        return ray.cloudpickle.dumps(factory)
    except Exception as exc:
        raise TypeError(f"factory must be an import path 'package.module:function' or a callable that "
                        f"cloudpickle can serialize: {exc!r}") from exc

