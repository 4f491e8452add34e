"""What tests read from the operating system, per platform (Linux and macOS): peak RSS, open file
descriptors, child processes. Imported by name (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

__all__ = ["LINUX", "MACOS", "child_pids", "open_fds", "peak_rss_kib"]

LINUX = sys.platform.startswith("linux")
MACOS = sys.platform == "darwin"


def peak_rss_kib() -> int:
    """This process's peak resident set size in KiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if MACOS else peak


def open_fds() -> set[str]:
    """This process's open file descriptors (``/proc/self/fd`` on Linux, ``/dev/fd`` on macOS)."""
    return set(os.listdir("/proc/self/fd" if LINUX else "/dev/fd"))


def child_pids() -> set[int]:
    """Children of this process, zombies included until reaped (``/proc`` on Linux, ``pgrep -P``
    elsewhere)."""
    if not LINUX:
        out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
        return {int(pid) for pid in out.split()}
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(pid) for pid in (task / "children").read_text().split())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return pids
