"""The pooling a GGUF file declares: llama.cpp's ``{arch}.pooling_type``.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes ``<architecture>.pooling_type`` from a
repo's sentence-transformers ``1_Pooling/config.json`` (the Qwen3-Embedding GGUFs carry 3, "last");
the MLX checkpoint converted from the file (``models.gguf``) keeps no trace of it, so it is read
from the file's header here (:func:`models.gguf_file.read_header`: bounded, checked).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..gguf_file import read_header
from ._st_config import Pooling

__all__ = ["GGUF_POOLINGS", "gguf_pooling"]

#: llama.cpp's ``enum llama_pooling_type`` -> the pooling it stands for (0 "none" and 4 "rank":
#: not an embedding model's pooling).
GGUF_POOLINGS: dict[int, Pooling] = {1: "mean", 2: "cls", 3: "last"}


def _gguf_file(spec: str | os.PathLike[str]) -> Path | None:
    """The ``.gguf`` file a model source names (as ``models.sources.resolve`` reads it: the file, or
    the one ``.gguf`` of a directory without config.json), else None."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def gguf_pooling(spec: str | os.PathLike[str] | None) -> Pooling | None:
    """The pooling ("last", "mean" or "cls") the GGUF file model source ``spec`` declares in its
    ``<general.architecture>.pooling_type``; None when ``spec`` names no GGUF file or the file
    declares none (or "none" / "rank"). Raises GGUFError (a ValueError) for a malformed file."""
    if spec is None:
        return None
    file = _gguf_file(spec)
    if file is None:
        return None
    meta = read_header(file).metadata
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    return GGUF_POOLINGS.get(value) if isinstance(value, int) and not isinstance(value, bool) else None
