"""Model families by config.json's ``model_type``: one module per family (mlx-lm's
``_get_classes`` in ``mlx_lm/utils.py`` is the precedent), each a :class:`Family`.

A family module reads its config.json into a :class:`~models.config.DecoderConfig` (its
defaults, its hooks, its refusals) and names the config of its seeded checkpoints; the decoder
(:mod:`models.decoder.layers`), the loader (:mod:`models.loader`) and the writer
(:mod:`models.seeded_checkpoint`) are shared. No family imports another. Adding one: a module
here and a line in :data:`FAMILIES` (docs/models.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Mapping, Protocol

from ...serving._json import JSON, JSONObject
from .._checkpoint import read_config_files, read_json, show
from ..config import DecoderConfig

__all__ = ["FAMILIES", "Family", "family", "model_type", "read_config"]

#: config.json ``model_type`` -> family module. Mistral (7B v0.2+, Nemo) is the Llama
#: architecture (mlx-lm maps it the same way); its config is checked by the llama family.
FAMILIES: dict[str, str] = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama"}


class Family(Protocol):
    """What a family module provides."""

    #: seeded-checkpoint shapes by preset name (``hidden_size``, ``num_hidden_layers``, ...)
    PRESETS: Mapping[str, Mapping[str, Any]]

    def config_from_dict(self, raw: JSONObject, generation: Mapping[str, JSON] | None = None,
                         where: str = "config.json") -> DecoderConfig:
        """The checked config (ValueError / MissingFieldError naming ``where`` and the field)."""

    def checkpoint_config(self, preset: str) -> JSONObject:
        """config.json of a seeded checkpoint of ``preset`` (a key of ``PRESETS``)."""


def family(name: str) -> Family:
    """The family module registered for ``model_type`` ``name`` (ValueError naming the supported
    types when there is none)."""
    if name not in FAMILIES:
        raise ValueError(f"model_type {show(name)} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return importlib.import_module(f"{__name__}.{FAMILIES[name]}")


def _json_object(raw: JSON, where: str) -> JSONObject:
    """``raw`` when it is a JSON object (ValueError naming ``where`` when it is not)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    return raw


def _model_type(raw: JSON, where: str) -> str:
    kind = _json_object(raw, where).get("model_type")
    if not isinstance(kind, str) or kind not in FAMILIES:  # a list or object is no model_type either
        raise ValueError(f"{where}: model_type {show(kind)} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    return kind


def model_type(path: str | Path) -> str:
    """config.json's ``model_type`` (ValueError naming the file when absent or unsupported;
    FileNotFoundError when config.json is missing)."""
    root = Path(path)
    cfg = root / "config.json"
    if not cfg.is_file() and not cfg.is_symlink():
        raise FileNotFoundError(f"checkpoint {root}: missing file config.json ({cfg})")
    return _model_type(read_json(cfg, root), str(cfg))


def read_config(path: str | Path) -> DecoderConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, its
    ``eos_token_id`` list wins over config.json's) from a checkpoint directory through the family
    of its ``model_type``.

    Raises FileNotFoundError naming config.json when it is missing; ValueError naming the file
    (and the field) when either is unreadable, not a JSON object, too large, a symlink out of the
    directory, holds an unsupported ``model_type`` or a bad value.
    """
    raw, generation, where = read_config_files(path)
    config = _json_object(raw, where)
    return family(_model_type(config, where)).config_from_dict(config, generation, where=where)
