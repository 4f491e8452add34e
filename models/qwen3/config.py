"""Qwen3 checkpoint configuration: ``config.json`` + ``generation_config.json``.

Field names follow the Hugging Face ``Qwen3Config`` (transformers) as shipped in
mlx-community / lmstudio-community MLX checkpoints.

A checkpoint is untrusted input: every field is type- and range-checked here, before
any tensor is read or any buffer sized from it, and a bad value raises ``ValueError``
naming the file and the field (a missing required field raises :class:`MissingFieldError`,
both a ``KeyError`` and a ``ValueError``). Files are read with a size cap and must stay
inside the checkpoint directory (:func:`checkpoint_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .._checkpoint import (LIMITS, MAX_JSON_BYTES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, SUPPORTED_MODES,
                           MissingFieldError, QuantSpec, Quantization, checkpoint_file, decoder_fields,
                           float_field, optional, read_config_files, read_json, show)

__all__ = ["MissingFieldError", "QuantSpec", "Quantization", "Qwen3Config", "checkpoint_file",
           "read_config", "read_json"]

#: Qwen3 ships rope_theta = 1,000,000 (not the 10,000 RoPE default).
DEFAULT_ROPE_THETA = 1_000_000.0
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
# LIMITS, MAX_JSON_BYTES, SUPPORTED_*: the checks every family shares (models/_checkpoint.py).


@dataclass(frozen=True)
class Qwen3Config:
    """Architecture fields of a Qwen3 checkpoint (all lengths in tokens)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Quantization | None = None


def config_from_dict(raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                     where: str = "config.json") -> Qwen3Config:
    """Build a :class:`Qwen3Config` from parsed config.json (and generation_config.json).

    Raises ValueError naming the field for an architecture other than Qwen3, an unsupported
    quantization mode / bits / group size or RoPE scaling, and any value of the wrong type
    or out of range (integers: see :data:`LIMITS`; ``num_key_value_heads`` must divide
    ``num_attention_heads``; ``head_dim`` even; ``rms_norm_eps`` in (0, 1]; ``rope_theta``
    finite and >= 1); :class:`MissingFieldError` (a KeyError and a ValueError) naming a
    missing required field.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    arch = optional(raw, "architectures", [])
    model_type = raw.get("model_type")
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise ValueError(f"{where}: architectures must be a list of strings, got {show(arch)}")
    if model_type != "qwen3" and not any(a in SUPPORTED_ARCHITECTURES for a in arch):
        raise ValueError(
            f"{where}: unsupported architecture (model_type={show(model_type)}, architectures={show(arch)}); "
            f"only Qwen3 ({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
        )
    if raw.get("rope_scaling"):
        raise ValueError(f"{where}: rope_scaling {show(raw['rope_scaling'])} is not supported")
    rope_parameters = optional(raw, "rope_parameters", {})
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"{where}: rope_parameters must be an object, got {show(rope_parameters)}")
    if rope_parameters.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"{where}: rope_parameters.rope_type {show(rope_parameters['rope_type'])} "
                         "is not supported")
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:
        rope_theta = rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA)
    fields = decoder_fields(raw, generation, where, max_position_embeddings=40960, rms_norm_eps=1e-6)
    tie = optional(raw, "tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {show(tie)}")
    return Qwen3Config(
        **fields,
        rope_theta=float_field(rope_theta, where, "rope_theta", 1.0, 1e15, lo_open=False),
        tie_word_embeddings=tie,
    )


def read_config(path: str | Path) -> Qwen3Config:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, its
    ``eos_token_id`` list wins over config.json's) from a checkpoint directory.

    Raises FileNotFoundError naming config.json when it is missing; ValueError naming the
    file (and the field) when either is unreadable, not a JSON object, too large (over
    :data:`MAX_JSON_BYTES`), a symlink out of the directory, or holds a bad value.
    """
    raw, generation, where = read_config_files(path)
    return config_from_dict(raw, generation, where=where)
