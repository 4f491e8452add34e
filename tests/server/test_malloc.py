"""glibc's malloc as ``serve`` sets it (``server/_malloc.py``): 2 arenas, put in the environment for
the processes it starts; an mmap threshold only when asked, and never over the environment's.
Each case runs in a fresh interpreter (the settings are process-wide)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

def _glibc_with_mallinfo2() -> bool:
    """Linux with glibc >= 2.33 (the probe reads ``mallinfo2``); musl or an older glibc: False."""
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/self/status"):
        return False
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc's malloc (Linux, glibc >= 2.33)")

#: After a 1 MiB block is freed glibc raises its dynamic mmap threshold to 1 MiB; is a 512 KiB
#: block then mapped on its own (the threshold fixed lower) or taken from the heap?
_PROBE = """
import ctypes, json, os, sys
from mlx_serving.server._malloc import tune_malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tune_malloc(*json.loads(sys.argv[1]))
libc.free(libc.malloc(1 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(512 << 10)
print(json.dumps({"mapped": libc.mallinfo2().hblkhd - before >= 512 << 10,
                  "arenas": os.environ.get("MALLOC_ARENA_MAX"), "threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}))
"""


def _probe(args: list[int], **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args)], capture_output=True, text=True,
                          check=True, env={**clean, **env})
    return json.loads(done.stdout)


def test_serve_caps_the_arenas_and_leaves_glibcs_mmap_threshold() -> None:
    assert _probe([]) == {"mapped": False, "arenas": "2", "threshold": None}


def test_an_mmap_threshold_maps_large_blocks_on_their_own() -> None:
    assert _probe([128 << 10]) == {"mapped": True, "arenas": "2", "threshold": str(128 << 10)}


def test_the_environment_wins() -> None:
    assert _probe([128 << 10], MALLOC_ARENA_MAX="4", MALLOC_MMAP_THRESHOLD_=str(4 << 20)) == {
        "mapped": False, "arenas": "4", "threshold": str(4 << 20)}
