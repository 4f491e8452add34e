"""Spawning a worker without multiprocessing's resource tracker in the caller.

A stock spawn start (``multiprocessing.get_context("spawn").Process.start``) first makes sure the
caller runs a *resource tracker*: a helper process, started once on first use, that lives until
the caller exits and is handed to every spawned child so that the child's named semaphores and
shared memory are unlinked if it dies. For a pool that would leave a child process of the caller
running after ``close()``, and it is a process shared with everything else in the caller, so the
pool could not stop it safely (stopping it unlinks whatever the rest of the program registered,
and waits for every other spawned child to exit).

`WorkerProcess` starts its child exactly as a spawn start does, but passes no tracker: the
caller starts none, and a worker that does use named semaphores or shared memory starts its own
tracker on first use (spawn's child code handles ``tracker_fd=None``). That tracker is the
worker's child, it is not the caller's, and it cleans up after the worker however the worker ends.
"""

from __future__ import annotations

import io
import os
from multiprocessing import context, popen_spawn_posix, spawn, util
from typing import Any

__all__ = ["WorkerProcess"]


class _TrackerlessPopen(popen_spawn_posix.Popen):
    """``popen_spawn_posix.Popen`` without ``resource_tracker.getfd()`` (the rest is the stdlib's
    ``_launch``, unchanged from Python 3.10 to 3.13)."""

    _fds: list[int]  # set by popen_spawn_posix.Popen.__init__ (typeshed leaves it out)

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            # typeshed's multiprocessing.context leaves out the module's ``reduction`` global
            context.reduction.dump(prep_data, fp)  # type: ignore[attr-defined]
            context.reduction.dump(process_obj, fp)  # type: ignore[attr-defined]
        finally:
            context.set_spawning_popen(None)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=None, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            # typeshed types ``path`` as bytes; the stdlib itself passes this str
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)  # type: ignore[arg-type]
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
            # typeshed's multiprocessing.util leaves out ``close_fds``
            self.finalizer = util.Finalize(self, util.close_fds, fds_to_close)  # type: ignore[attr-defined]
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class WorkerProcess(context.SpawnProcess):
    """A spawn-method ``Process`` that starts no resource tracker in the caller."""

    @staticmethod
    def _Popen(process_obj: Any) -> _TrackerlessPopen:  # noqa: N802 (multiprocessing's name)
        return _TrackerlessPopen(process_obj)
