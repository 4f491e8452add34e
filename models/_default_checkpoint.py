"""The embedded default checkpoint: a seeded random Qwen3-0.6B-shaped MLX 4-bit checkpoint,
written once into the user cache directory so the CLI works on a fresh machine (no model hub).
Random weights give meaningless text; pass a real checkpoint directory for real text."""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["DEFAULT_PRESET", "DEFAULT_SEED", "cache_dir", "default_checkpoint"]

DEFAULT_PRESET = "0.6b"
DEFAULT_SEED = 0


def cache_dir() -> Path:
    """``$MLX_SERVING_CACHE``, else ``$XDG_CACHE_HOME/mlx-serving``, else ``~/.cache/mlx-serving``."""
    if os.environ.get("MLX_SERVING_CACHE"):
        return Path(os.environ["MLX_SERVING_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-serving"


def write_checkpoint(path: Path, preset: str, seed: int, **options: Any) -> Path:
    """``models.seeded_checkpoint.write_checkpoint``, imported on first use: importing the package
    does not import the writer, so ``python -m mlx_serving.models.seeded_checkpoint`` runs without
    runpy's "found in sys.modules" RuntimeWarning."""
    from .seeded_checkpoint import write_checkpoint as write

    return write(path, preset, seed, **options)


def default_checkpoint() -> Path:
    """Path of the embedded default checkpoint, written first if it is not there yet.

    The checkpoint is a seeded RANDOM Qwen3-0.6B-shaped MLX 4-bit checkpoint (the mlx-community
    layout, with the Qwen3 tokenizer files; same seed, same bytes), so its text is meaningless:
    it lets the serving run on a machine without a model hub. It lives in
    ``cache_dir() / "qwen3-0.6b-random-4bit-seed0"``, where ``cache_dir()`` is
    ``$MLX_SERVING_CACHE`` if set, else ``$XDG_CACHE_HOME/mlx-serving``, else
    ``~/.cache/mlx-serving``. Writing it (about 335 MB, 5-30 s on CPU) shows a tqdm progress bar
    on stderr.

    Safe against interruption and concurrency: the checkpoint is written into a temporary
    sibling directory and renamed into place, so the path only ever holds a complete checkpoint
    and an interrupted write leaves nothing behind. When several processes call this at once,
    each writes its own copy; the first rename wins and the others use the winner's copy.
    Raises OSError if the cache directory cannot be written.
    """
    target = cache_dir() / f"qwen3-{DEFAULT_PRESET}-random-4bit-seed{DEFAULT_SEED}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.writing-", dir=target.parent))
    try:
        bar = partial(tqdm, desc=f"writing the default checkpoint to {target}", unit="layer")
        write_checkpoint(tmp, DEFAULT_PRESET, DEFAULT_SEED, progress=bar)
        try:
            tmp.rename(target)  # atomic; fails if another process renamed its copy first
        except OSError:
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(path: Path) -> bool:
    """A checkpoint directory only appears by rename once fully written, so config.json marks it."""
    return (path / "config.json").is_file()
