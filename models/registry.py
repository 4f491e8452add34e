"""Model families by ``model_type``: which package loads a checkpoint and runs its forward pass.

A family is a package under ``models/`` with a ``loader.load(path, **options) -> State`` and a
``model`` module providing the forward pass the engine calls (mlx-lm's ``_get_classes`` in
``mlx_lm/utils.py`` is the precedent: one module per architecture, picked by config.json's
``model_type``). A family's ``State`` names its family in the class attribute ``family``.
docs/models.md lists the families and how to add one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ._checkpoint import read_json, show

__all__ = ["FAMILIES", "family_model", "load", "model_type"]

#: config.json ``model_type`` -> family package under ``models/``. Mistral (7B v0.2+, Nemo) is
#: the Llama architecture (mlx-lm maps it the same way); its config is checked by the llama family.
FAMILIES: dict[str, str] = {"qwen3": "qwen3", "llama": "llama", "mistral": "llama"}


def model_type(path: str | Path) -> str:
    """config.json's ``model_type`` (ValueError naming the file when absent or unsupported;
    FileNotFoundError when config.json is missing)."""
    root = Path(path)
    cfg = root / "config.json"
    if not cfg.is_file() and not cfg.is_symlink():
        raise FileNotFoundError(f"checkpoint {root}: missing file config.json ({cfg})")
    raw = read_json(cfg, root)
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or kind not in FAMILIES:  # a list or object is no model_type either
        raise ValueError(f"{cfg}: model_type {show(kind)} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return kind


def load(path: str | Path, **options: Any) -> Any:
    """Load the checkpoint at ``path`` with its family's loader (``options`` go to it)."""
    package = FAMILIES[model_type(path)]
    loader = importlib.import_module(f"{__package__}.{package}.loader")
    return loader.load(path, **options)


def family_model(state: Any) -> ModuleType:
    """The ``model`` module of ``state``'s family: ``forward(state, cache, rows)`` (through the
    KV-cache seam of :mod:`models.generation.attention`) and ``decode_path(state)``."""
    return importlib.import_module(f"{__package__}.{state.family}.model")
