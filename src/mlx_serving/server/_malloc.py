"""glibc's malloc set for a serving process's memory: ``mlx-serving serve`` calls
:func:`tune_malloc` first thing (bench/kv_quant_rss.py's in-process runs too, to be the server's).
No-op off glibc, and for each setting the environment already gives (glibc reads
``MALLOC_ARENA_MAX`` / ``MALLOC_MMAP_THRESHOLD_`` itself at start-up).

At most 2 arenas (``M_ARENA_MAX``): the server's ~20 threads (uvicorn, anyio's pool, the executor,
MLX, OpenMP) otherwise each grow an arena; peak RSS of a 1-stream server on SmolLM2-135M was 244 MiB
against 232 with 2 arenas (/proc VmHWM after four 128-token completions, 2-core x86-64). The
setting is also put in the environment, so that the processes the server starts (a ``--workers``
pool's) begin with it.

glibc's mmap threshold is left as it is by default: fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_=131072``
in the environment, or ``mmap_threshold``) the prefill's large transient buffers go back to the
system when freed instead of staying on the heap's free lists: less peak RSS at 32 streams on
SmolLM2-135M (~26-32 MiB), for ~12% more CPU time per prefill token and ~4% per 32-row step (the page faults of
mapping them afresh): docs/benchmarks.md, issue 42.
"""

from __future__ import annotations

import os
import sys

__all__ = ["tune_malloc"]

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # malloc.h


def tune_malloc(mmap_threshold: int | None = None) -> None:
    """Cap glibc's arenas at 2 and, when ``mmap_threshold`` (bytes) is given, fix its mmap
    threshold there (the benchmarks' way to compare): each unless its environment variable is set,
    then put there for the processes started from here. Nothing off Linux or off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to set
        return
    for env, param, value in (("MALLOC_ARENA_MAX", _M_ARENA_MAX, 2),
                              ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, mmap_threshold)):
        if value is not None and not os.environ.get(env) and mallopt(param, value):  # 0: refused
            os.environ[env] = str(value)  # read by glibc in the processes started from here
