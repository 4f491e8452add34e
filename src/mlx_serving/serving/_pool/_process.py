"""``ProcessBackend``: a ``ServingPool``'s workers as spawned processes on this host, each with a
socket connection, its stderr relayed, and a liveness monitor fed by the workers' heartbeats."""

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
from typing import Any

from .._errors import WorkerCrashed, WorkerUnresponsive
from .._request import Request
from ._backend import PoolEvents, PoolWorker
from ._base import check_factory_path, fail
from ._connection import ProcessWorker, WireConsumer, finish, kill
from ._remote import rebuild_error
from ._spawn import WorkerProcess
from ._stderr import exit_report, start_with_stderr_relay
from ._wire import Ready, Shutdown, StartFailed, decode_from_worker, encode_payload, recv_frame
from ._worker import Factory, main, resolve_factory

__all__ = ["POOL_WORKERS_ENV", "ProcessBackend"]

#: Set in each worker process to the pool's worker count: the processes share one machine, so
#: memory budgets taken from it (a text-generation serving's KV cache) are split between them.
POOL_WORKERS_ENV = "MLX_SERVING_POOL_WORKERS"

_SPAWN_LOCK = threading.Lock()  # os.environ and fd 2 are process-wide: one spawn at a time edits them
_TAIL_WAIT = 0.5  # seconds to wait for a dead worker's last stderr output
_DUMP_WAIT = 0.5  # seconds an unresponsive worker has to write its stacks (SIGUSR1) before SIGKILL
_HEARTBEAT = 1.0  # default heartbeat interval (s), or a quarter of liveness_timeout when shorter
_WATCHED = ("ready", "closing")  # the states in which a worker must keep sending heartbeats

WorkerEnv = Sequence[Mapping[str, str]] | Callable[[int], Mapping[str, str]]


class ProcessBackend:
    """A ``ServingPool``'s workers as processes started with the spawn method (the default
    backend): the factory's module must be importable in a fresh interpreter, and a callable
    factory must be picklable. A worker that dies is replaced (its calls fail with
    ``WorkerCrashed``, whose message ends with the worker's stderr).

    worker_env: environment variables per worker, a sequence with one mapping per worker or a
      function of the worker index (e.g. ``lambda i: {"CUDA_VISIBLE_DEVICES": str(i)}``); set
      before the worker's interpreter starts, and again for a restarted worker.
    liveness_timeout: seconds a started worker may send nothing, not even a heartbeat, before it
      is declared unresponsive (default 10; None disables the check). An unresponsive worker
      gets no new requests, its in-flight requests fail with ``WorkerUnresponsive``, it is sent
      SIGUSR1 (its threads' stacks go to its stderr), killed with SIGKILL and replaced.
    heartbeat_interval: seconds between the heartbeats of a worker's event loop (default 1, or a
      quarter of ``liveness_timeout`` when that is shorter); must be below ``liveness_timeout``.

    Raises ValueError for a bad ``liveness_timeout`` / ``heartbeat_interval`` (here) or
    ``worker_env`` (when a pool binds it: ``ServingPool`` raises it), TypeError for a
    ``worker_env`` that does not map str to str.
    """

    worker_name = "pool worker"

    def __init__(self, *, worker_env: WorkerEnv | None = None, liveness_timeout: float | None = 10.0,
                 heartbeat_interval: float | None = None) -> None:
        self._liveness_timeout, self._heartbeat_interval = _liveness(liveness_timeout, heartbeat_interval)
        self._worker_env = worker_env
        self._envs: list[Mapping[str, str]] = []
        self._factory: Factory | None = None
        self._process_options: dict[str, Any] = {}
        self._events: PoolEvents | None = None
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def bind(self, factory: Factory, workers: int, process_options: dict[str, Any], events: PoolEvents) -> None:
        """Check the factory (ValueError / TypeError) and ``worker_env``; start the liveness
        monitor."""
        if self._events is not None:
            raise RuntimeError("this ProcessBackend serves a pool already; make one per pool")
        _check_factory(factory)
        shared = {POOL_WORKERS_ENV: str(workers)}  # the workers share this machine's memory
        self._envs = [{**shared, **env} for env in _envs(self._worker_env, workers)]
        self._factory, self._process_options, self._events = factory, process_options, events
        if self._liveness_timeout is not None:
            self._monitor = threading.Thread(
                target=self._watch, args=(events, self._liveness_timeout), name="serving-pool-monitor", daemon=True
            )
            self._monitor.start()

    def consumer(self) -> WireConsumer:
        return WireConsumer()

    def encode(self, input: object) -> object:
        """The input as the payload of a ``Call``; TypeError if it cannot be pickled."""
        return encode_payload(input)

    # --- starting -----------------------------------------------------------------------------

    def start(self, index: int, lock: threading.Condition, orphans: deque[Request]) -> ProcessWorker:
        """Spawn slot ``index``'s worker process with its environment."""
        assert self._events is not None, "bind() first"
        ours, theirs = socket.socketpair()
        process = WorkerProcess(
            target=main,
            args=(theirs, self._factory, self._process_options, self._heartbeat_interval),
            name=f"serving-pool-worker-{index}",
            daemon=True,
        )
        try:
            with _SPAWN_LOCK, _environment(self._envs[index]):
                relay = start_with_stderr_relay(process.start, f"serving-pool-stderr-{index}")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ProcessWorker(index, process, ours, relay, lock, orphans, self._events)

    def await_ready(self, worker: PoolWorker, deadline: float) -> None:
        """Wait for the worker's first message; raise its start error, or on death / timeout."""
        assert isinstance(worker, ProcessWorker)
        worker.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            frame = recv_frame(worker.sock)
        except TimeoutError:
            summary = f"{worker.name()} did not start in time (start_timeout)"
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

    # --- stopping -----------------------------------------------------------------------------

    def kill(self, worker: PoolWorker) -> None:
        assert isinstance(worker, ProcessWorker)
        kill(worker)

    def stop(self, workers: list[PoolWorker], live: list[PoolWorker], timeout: float) -> None:
        """Send ``Shutdown(timeout)`` to the live workers, then wait for every worker to exit
        (killed at ``timeout`` + 5 s) and for its reader to end."""
        for worker in live:
            assert isinstance(worker, ProcessWorker)
            with contextlib.suppress(OSError):
                worker.post(Shutdown(timeout))
        deadline = time.monotonic() + timeout + 5.0
        for worker in workers:
            assert isinstance(worker, ProcessWorker)
            finish(worker, deadline)

    def close(self) -> None:
        """Stop the liveness monitor (it watched the closing workers until now)."""
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join()

    # --- liveness -----------------------------------------------------------------------------

    def _watch(self, events: PoolEvents, timeout: float) -> None:
        """The monitor thread: declare unresponsive every ready or closing worker that sent
        nothing for ``timeout`` (liveness_timeout) s; runs until ``close()``."""
        while True:
            wait = self._heartbeat_interval
            for worker in events.watched(_WATCHED):
                assert isinstance(worker, ProcessWorker)
                silent = time.monotonic() - worker.heard_at
                if silent < timeout:
                    wait = min(wait, timeout - silent)
                elif _has_unread(worker.sock):  # it did speak: this process fell behind reading
                    wait = min(wait, 0.05)
                else:
                    self._unresponsive(events, worker, silent)
            if self._monitor_stop.wait(max(wait, 0.005)):
                return

    def _unresponsive(self, events: PoolEvents, worker: ProcessWorker, silent: float) -> None:
        """Stop routing to ``worker``, start its replacement, have it dump its stacks, kill it
        (SIGKILL) and fail its calls with WorkerUnresponsive. Its reader then reaps it."""
        detached = events.detach(worker, "unresponsive", "unresponsive", expect=_WATCHED)
        if detached is None:  # its connection ended meanwhile
            return
        pending = detached[1]
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
        events.retire(worker, worker.calls(pending))
        for request in pending.values():
            summary = (
                f"{worker.name()} sent nothing, not even a heartbeat, for {silent:.1f} s (liveness_timeout "
                f"{self._liveness_timeout} s) while running request {request.id}; it was killed"
            )
            fail(request, WorkerUnresponsive(exit_report(summary, tail)))


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
    check_factory_path(factory)
    if isinstance(factory, str):
        return
    resolve_factory(factory)
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            f"factory must be an import path 'package.module:function' or a picklable callable "
            f"(workers start with the spawn method): {exc!r}"
        ) from exc


def _envs(worker_env: WorkerEnv | None, workers: int) -> list[Mapping[str, str]]:
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
