"""Model families by ``model_type``: which package loads a checkpoint and runs its forward pass.

A family is a package under ``models/`` with a ``loader.load(path, **options) -> State`` and a
``model`` module providing the forward pass the engine calls (mlx-lm's ``_get_classes`` in
``mlx_lm/utils.py`` is the precedent: one module per architecture, picked by config.json's
``model_type``). A family's ``State`` names its family in the class attribute ``family``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from .qwen3.config import read_json

__all__ = ["FAMILIES", "family_model", "load", "model_type"]

#: config.json ``model_type`` -> family package under ``models/``.
FAMILIES: dict[str, str] = {"qwen3": "qwen3"}


def model_type(path: str | Path) -> str:
    """config.json's ``model_type`` (ValueError naming the file when absent or unsupported;
    FileNotFoundError when config.json is missing)."""
    root = Path(path)
    cfg = root / "config.json"
    if not cfg.is_file() and not cfg.is_symlink():
        raise FileNotFoundError(f"checkpoint {root}: missing file config.json ({cfg})")
    raw = read_json(cfg, root)
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind not in FAMILIES:
        raise ValueError(f"{cfg}: model_type {kind!r} is not supported (supported: {sorted(FAMILIES)})")
    return kind


def load(path: str | Path, **options: Any) -> Any:
    """Load the checkpoint at ``path`` with its family's loader (``options`` go to it)."""
    package = FAMILIES[model_type(path)]
    loader = importlib.import_module(f"{__package__}.{package}.loader")
    return loader.load(path, **options)


def family_model(state: Any) -> ModuleType:
    """The ``model`` module of ``state``'s family: ``forward(state, cache, rows)``,
    ``decode_path(state)``, ``compiled_decode(state, max_len, kv_len)``."""
    return importlib.import_module(f"{__package__}.{state.family}.model")
