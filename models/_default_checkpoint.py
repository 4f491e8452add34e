"""The embedded default checkpoint: a seeded random Qwen3-0.6B-shaped MLX 4-bit checkpoint,
written once into the user cache directory so the CLI works on a fresh machine (no model hub).
Random weights give meaningless text; pass a real checkpoint directory for real text."""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

from tqdm import tqdm

from .qwen3.checkpoint import write_checkpoint

__all__ = ["DEFAULT_PRESET", "DEFAULT_SEED", "cache_dir", "default_checkpoint"]

DEFAULT_PRESET = "0.6b"
DEFAULT_SEED = 0


def cache_dir() -> Path:
    """``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``."""
    if os.environ.get("MLX_SERVING_CACHE"):
        return Path(os.environ["MLX_SERVING_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-serving"


def default_checkpoint() -> Path:
    """Path of the default checkpoint, writing it first if absent (about 330 MB, ~20 s on 2 CPU
    cores). Written into a temporary sibling and renamed, so an interrupted run leaves nothing."""
    target = cache_dir() / f"qwen3-{DEFAULT_PRESET}-random-4bit-seed{DEFAULT_SEED}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=target.parent))
    try:
        bar = partial(tqdm, desc=f"writing the default checkpoint to {target}", unit="layer")
        write_checkpoint(tmp, DEFAULT_PRESET, DEFAULT_SEED, progress=bar)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
