"""``ModelRegistry``: the models a server answers for, each loaded at start or on demand.

A model given as a client (or ``ServedModel``) is loaded from the start and never unloaded; one
given as a :class:`~._models.Lazy` is loaded at its first request (``pick``), on a thread, and
unloaded (its client closed) once idle past its keep-alive, or to make room for another under
``max_loaded`` (the least recently used idle one first). A model with requests in flight is never
unloaded: :class:`LeaseScope` (ASGI middleware) holds each model a request picked until its
response was sent whole (a stream included) or the request ended otherwise. Every state change
happens on the event loop; loads and closes run on threads. What Ollama and llama-server's router do.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import anyio
from anyio.abc import TaskGroup

from ..serving import Client, ServingStats
from ..serving._json import JSONObject
from ..serving._progress import Progress
from ._errors import RETRY_AFTER_S, APIError
from ._keep_alive import NEVER, parse_keep_alive
from ._metrics import Lifecycle
from ._models import Lazy, ServedModel, Task, model_object

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["LeaseScope", "Loader", "ModelRegistry", "Models"]

_log = logging.getLogger("mlx_serving.server")

Models = Mapping[str, Client | ServedModel | Lazy]
Loader = Callable[[], Models]
State = Literal["unloaded", "loading", "loaded", "unloading", "failed"]

#: The releases of the models the current HTTP request picked (set by LeaseScope).
_LEASES: ContextVar[list[Callable[[], None]]] = ContextVar("mlx_serving_leases")


class LeaseScope:
    """ASGI middleware: the models an HTTP request picks stay held (in flight: never unloaded)
    until the request ends, its response sent whole or abandoned."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        leases: list[Callable[[], None]] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            for release in leases:
                release()


@dataclass(eq=False)
class _Entry:
    """One served model: ``load`` None for one given loaded (never unloaded); ``last_use`` and
    ``expires`` on the monotonic clock (``expires``: when it unloads once idle, inf: never)."""

    load: Callable[[], Client | ServedModel] | None
    model: ServedModel | None = None
    state: State = "unloaded"
    progress: Progress | None = None
    in_flight: int = 0
    last_use: float = 0.0
    expires: float = NEVER
    error: str = ""
    task: Task | None = None
    max_model_len: int | None = None
    loads: Counter[str] = field(default_factory=Counter)
    unloads: Counter[str] = field(default_factory=Counter)

    def idle(self) -> bool:
        """Loaded on demand, loaded now and with no request in flight: it may be unloaded."""
        return self.load is not None and self.state == "loaded" and self.in_flight == 0


class ModelRegistry:
    """The served models and their states. ``keep_alive``: seconds a model loaded on demand stays
    loaded once idle (``NEVER``: until evicted); ``max_loaded``: most models loaded (or loading, or
    unloading) at once (None: no cap); ``load_wait``: seconds a request waits for its model to
    load (503 + Retry-After past it). ``status`` is the start's: "loading" until ``ready`` (a
    loader still running), then "ready", or "failed". Raises ValueError for a bad setting."""

    def __init__(self, stuck_after: float, keep_alive: float = NEVER, max_loaded: int | None = None,
                 load_wait: float = 600.0) -> None:
        if not keep_alive >= 0:
            raise ValueError(f"keep_alive must be >= 0 seconds (NEVER: never unload), got {keep_alive}")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1 (None: no cap), got {max_loaded}")
        if not 0 < load_wait < math.inf:
            raise ValueError(f"load_wait must be a finite number of seconds > 0, got {load_wait}")
        self.status, self.error = "loading", ""
        self.owned = False
        self.created = int(time.time())
        self._stuck_after, self._keep_alive = stuck_after, keep_alive
        self._max_loaded, self._load_wait = max_loaded, load_wait
        self._entries: dict[str, _Entry] = {}
        self._changed: anyio.Event | None = None  # set and replaced at each change (while running)
        self._tasks: TaskGroup | None = None

    def ready(self, models: Models, owned: bool) -> None:
        """Serve ``models`` (``owned``: close the clients given loaded at shutdown). Raises
        ValueError for an empty mapping."""
        if not models:
            raise ValueError("no model to serve: give at least one {name: client}")
        entries = {name: _Entry(m.load) if isinstance(m, Lazy) else _Entry(None) for name, m in models.items()}
        for (name, entry), m in zip(entries.items(), models.values()):
            if not isinstance(m, Lazy):
                self._loaded(entry, m)
        self._entries, self.owned, self.status = entries, owned, "ready"

    def not_ready(self) -> dict[str, str]:
        """``/health``'s body before ``ready``: the status and why (``detail``; ``error`` when failed)."""
        if self.status == "failed":
            return {"status": "failed", "detail": "loading the models failed; the server serves nothing",
                    "error": self.error}
        waited = time.time() - self.created
        return {"status": "loading", "detail": f"the models are loading ({waited:.0f} s so far); retry later"}

    def check_ready(self) -> None:
        """APIError 503 (Retry-After) until the start's loading is done."""
        if self.status != "ready":
            raise APIError(503, f"the server is {self.status}: no model is ready yet", "server_error",
                           code=self.status, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def pick(self, model: object, task: Task | None = None, keep_alive: object = None) -> tuple[str, ServedModel]:
        """The model a request names (None: the first one, of ``task`` when given), loaded (waiting
        for its load at most ``load_wait`` s) and held until the request ends (``LeaseScope``);
        ``keep_alive``: the request's (seconds or a duration, ``parse_keep_alive``; None: the
        registry's), how long the model stays loaded once idle after it. APIError 404 for an unknown
        model, 400 naming ``model`` for one of another ``task`` or ``keep_alive`` for a bad value,
        503 + Retry-After while the server or the model is loading, 500 naming the model when its
        load failed. RuntimeError outside an HTTP request of the app (no ``LeaseScope``)."""
        try:
            keep = self._keep_alive if keep_alive is None else parse_keep_alive(keep_alive)
        except ValueError as exc:
            raise APIError(400, str(exc), param="keep_alive") from None
        self.check_ready()
        name, entry = self._named(model, task)
        leases = _LEASES.get(None)
        if leases is None:
            raise RuntimeError("ModelRegistry.pick is called within an HTTP request of the app (LeaseScope)")
        if entry.state != "loaded":
            await self._wait_loaded(name, entry)
        entry.in_flight += 1
        leases.append(functools.partial(self._release, entry, keep))
        assert entry.model is not None  # loaded
        if task is not None:
            entry.model.check_task(name, task)
        return name, entry.model

    def models(self) -> list[JSONObject]:
        """``/v1/models``'s ``data``: every served model, with its ``status``."""
        return [self.describe(name) for name in self._entries]

    def describe(self, name: str) -> JSONObject:
        """One model's ``/v1/models`` object (not loading it); APIError 404 for an unknown one."""
        entry = self._entries.get(name)
        if entry is None:
            raise APIError(404, f"the model {name!r:.200} does not exist (served: {sorted(self._entries)})",
                           param="model", code="model_not_found")
        return model_object(name, self.created, entry.state, entry.task, entry.max_model_len)

    def stats(self) -> dict[str, ServingStats]:
        """Every loaded model's ``ServingStats`` (blocking for a pool: call off the event loop)."""
        loaded = [(name, e.model) for name, e in list(self._entries.items()) if e.state == "loaded"]
        return {name: m.client.stats() for name, m in loaded if m is not None}

    def stuck(self, stats: Mapping[str, ServingStats]) -> tuple[str, float] | None:
        """The first model of ``stats`` holding rows without progress past ``stuck_after``, with
        the seconds it has (``Progress``); None when none is."""
        for name, s in stats.items():
            entry = self._entries.get(name)
            idle = entry.progress.stuck_for(s) if entry is not None and entry.progress is not None else None
            if idle is not None:
                return name, idle
        return None

    def lifecycle(self) -> dict[str, Lifecycle]:
        """Each model's ``Lifecycle`` (the metrics')."""
        return {name: Lifecycle(e.state == "loaded", dict(e.loads), dict(e.unloads))
                for name, e in list(self._entries.items())}

    @asynccontextmanager
    async def running(self, loader: Loader | None,
                      on_load_error: Callable[[BaseException], None] | None) -> AsyncIterator[None]:
        """The registry at work while the app runs (its lifespan): ``loader`` (when given) run on a
        thread, then ``ready``; the keep-alive reaper and the loads and unloads; at the end, every
        model it owns closed. A loader that raises sets ``status`` "failed" and calls
        ``on_load_error(exc)``."""
        self._changed = anyio.Event()
        thread = None
        if loader is not None:
            thread = threading.Thread(target=self._load_all, args=(loader, on_load_error), name="mlx-serving-load",
                                      daemon=True)
            thread.start()
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._reap)
                try:
                    yield
                finally:
                    tasks.cancel_scope.cancel()
        finally:
            self._tasks = None
            if thread is not None:
                await anyio.to_thread.run_sync(thread.join)
            await self._close_all()

    def _load_all(self, loader: Loader, on_load_error: Callable[[BaseException], None] | None) -> None:
        try:
            self.ready(loader(), owned=True)
        except BaseException as exc:  # noqa: BLE001 - reported through /health and the callback
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            _log.error("loading the models failed: %s", self.error)
            if on_load_error is not None:
                on_load_error(exc)

    def _named(self, model: object, task: Task | None) -> tuple[str, _Entry]:
        if model is None:
            found = ([n for n, e in self._entries.items() if e.task == task]
                     or [n for n, e in self._entries.items() if e.task is None] or list(self._entries))
            return found[0], self._entries[found[0]]
        if isinstance(model, str) and model in self._entries:
            return model, self._entries[model]
        raise APIError(404, f"the model {model!r:.200} does not exist (served: {sorted(self._entries)})",
                       param="model", code="model_not_found")

    async def _wait_loaded(self, name: str, entry: _Entry) -> None:
        """Until ``entry`` is loaded (loading it, making room first), at most ``load_wait`` s."""
        if self._changed is None or self._tasks is None:
            raise RuntimeError("a model loaded on demand needs the app's lifespan (ModelRegistry.running)")
        seen_loading = False
        with anyio.move_on_after(self._load_wait):
            while entry.state != "loaded":
                if entry.state == "failed" and seen_loading:
                    raise APIError(500, f"loading the model {name!r} failed: {entry.error}", "server_error",
                                   param="model", code="model_load_failed")
                if entry.state in ("unloaded", "failed"):
                    self._make_room_or_load(name, entry)
                seen_loading |= entry.state == "loading"
                await self._change()
            return
        raise APIError(503, f"the model {name!r} is not loaded after {self._load_wait:g} s; retry later",
                       "server_error", code="model_loading", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _make_room_or_load(self, name: str, entry: _Entry) -> None:
        """Start loading ``entry`` when under ``max_loaded``; else start unloading the least
        recently used idle model (none idle: wait for a change)."""
        held = sum(e.state in ("loading", "loaded", "unloading") for e in self._entries.values())
        if self._max_loaded is None or held < self._max_loaded:
            entry.state = "loading"
            self._notify()
            assert self._tasks is not None
            self._tasks.start_soon(self._load, name, entry)
            return
        idle = [(e.last_use, n) for n, e in self._entries.items() if e.idle()]
        if idle:
            victim = min(idle)[1]
            self._unload(victim, self._entries[victim], "evicted")

    async def _load(self, name: str, entry: _Entry) -> None:
        assert entry.load is not None
        _log.info("loading the model %r", name)
        try:
            built = await anyio.to_thread.run_sync(entry.load)
        except Exception as exc:  # noqa: BLE001 - answered to the requests that wait for it
            entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
            entry.loads["failed"] += 1
            _log.error("loading the model %r failed: %s", name, entry.error)
        else:
            self._loaded(entry, built)
            entry.loads["ok"] += 1
        self._notify()

    def _loaded(self, entry: _Entry, built: Client | ServedModel) -> None:
        model = built if isinstance(built, ServedModel) else ServedModel(built)
        entry.model, entry.progress, entry.state, entry.error = model, Progress(self._stuck_after), "loaded", ""
        entry.task, entry.max_model_len = model.task, model.max_model_len
        entry.last_use = time.monotonic()
        entry.expires = entry.last_use + self._keep_alive

    def _unload(self, name: str, entry: _Entry, reason: str) -> None:
        """Start closing an idle model's client (``reason``: "keep_alive" or "evicted")."""
        model, entry.model, entry.progress, entry.state = entry.model, None, None, "unloading"
        _log.info("unloading the model %r (%s)", name, reason)
        assert model is not None and self._tasks is not None
        self._tasks.start_soon(self._close, name, entry, model, reason)
        self._notify()

    async def _close(self, name: str, entry: _Entry, model: ServedModel, reason: str) -> None:
        try:
            await model.client.aclose()
        except Exception:  # noqa: BLE001 - the model is gone either way
            _log.exception("closing the model %r failed", name)
        finally:
            entry.state = "unloaded"
            entry.unloads[reason] += 1
            self._notify()

    def _release(self, entry: _Entry, keep_alive: float) -> None:
        """A request that held ``entry`` ended: it stays loaded ``keep_alive`` s once idle."""
        entry.in_flight -= 1
        entry.last_use = time.monotonic()
        entry.expires = entry.last_use + keep_alive
        self._notify()

    async def _reap(self) -> None:
        """Unload each idle model past its keep-alive, waking at the next expiry or change."""
        while True:
            now = time.monotonic()
            for name, entry in self._entries.items():
                if entry.idle() and entry.expires <= now:
                    self._unload(name, entry, "keep_alive")
            nearest = min((e.expires for e in self._entries.values() if e.idle()), default=NEVER)
            with anyio.move_on_after(nearest - now):
                await self._change()

    async def _change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _close_all(self) -> None:
        for entry in self._entries.values():
            model, entry.model = entry.model, None
            if model is not None and (entry.load is not None or self.owned):
                await model.client.aclose()
