"""Device memory: what the default device can hold, its share for this process, and the checks
that keep a model and its KV cache inside it (on Apple Silicon, over-committing unified memory can
freeze or panic the machine: ml-explore/mlx#3186).

- :func:`device_limit`: bytes the device may hold in all: on a GPU, MLX's
  ``max_recommended_working_set_size`` (Metal) or ``memory_size``; None where MLX does not say (the
  CPU device: the OS manages memory there).
- :func:`available_memory`: what is left for this process's share: the device limit less MLX's
  active memory (weights loaded so far), divided among the processes of a ``ServingPool``
  (:data:`~mlx_serving.serving.POOL_WORKERS_ENV`); on the CPU the physical memory still free,
  divided the same way.
- :func:`check_fits`: ValueError naming the flag to lower when ``nbytes`` more would not fit.
- :func:`wire`: on Metal, wire what the serving holds (weights + KV cache + headroom), bounded by
  the recommended working set (mlx-lm's server wires the whole working set, which has frozen
  16 GB Macs); nowhere else.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx

from ...serving import POOL_WORKERS_ENV

__all__ = ["CPU_FALLBACK_BYTES", "WIRED_HEADROOM", "available_memory", "check_fits", "device_limit", "on_cpu",
           "on_cuda", "pool_share", "wire"]

log = logging.getLogger("mlx_serving")

#: Free memory assumed on the CPU where the OS does not report it (macOS has no SC_AVPHYS_PAGES).
CPU_FALLBACK_BYTES = 1 << 30
#: Fraction of what the serving holds added to the wired limit on Metal (activations, sampling).
WIRED_HEADROOM = 0.10


def on_cuda() -> bool:
    """True when the default device is a GPU of MLX's CUDA build (not Metal, not the CPU)."""
    cuda = getattr(mx, "cuda", None)  # absent from some non-CUDA builds
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def on_cpu() -> bool:
    """True when the default device is the CPU."""
    return mx.default_device() == mx.cpu


def device_limit() -> int | None:
    """Bytes the default device may hold in all, or None on the CPU / where MLX does not say."""
    if mx.default_device() != mx.gpu:
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    total = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
    return total or None


def pool_share() -> int:
    """How many processes share this machine's memory: the pool's worker count in a ServingPool
    worker (``POOL_WORKERS_ENV``), else 1 (a malformed value counts as 1)."""
    value = os.environ.get(POOL_WORKERS_ENV, "1")
    return max(int(value), 1) if value.isdigit() else 1


def available_memory() -> int:
    """Bytes this process may still use on the default device (see the module docstring)."""
    limit = device_limit()
    if limit is not None:
        return max(0, limit // pool_share() - mx.get_active_memory())
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        free = CPU_FALLBACK_BYTES
    return free // pool_share()


def check_fits(nbytes: int, what: str, flag: str) -> None:
    """ValueError unless ``nbytes`` more fit in the device's share (GPUs only: the CPU's OS pages and
    swaps, and its "free" figure leaves out reclaimable caches). The message names ``what`` and the
    ``flag`` that lowers it."""
    if device_limit() is None:
        return
    room = available_memory()
    if nbytes > room:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB but the device has {room / 2**30:.2f} GiB left for "
                         f"this process (device limit / pool workers - memory in use): lower {flag}")


def wire() -> int | None:
    """On Metal, set MLX's wired limit to what the process holds now (``mx.get_active_memory()``)
    plus :data:`WIRED_HEADROOM`, at most the device's share; the limit set (bytes), or None
    elsewhere."""
    limit = device_limit()
    if limit is None or not mx.metal.is_available():
        return None
    wired = min(int(mx.get_active_memory() * (1 + WIRED_HEADROOM)), limit // pool_share())
    mx.set_wired_limit(wired)
    log.info("wired memory limit: %.2f GiB", wired / 2**30)
    return wired
