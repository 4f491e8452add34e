"""Llama checkpoint configuration: ``config.json`` + ``generation_config.json``.

Field names follow the Hugging Face ``LlamaConfig`` (transformers) as shipped in mlx-community
MLX checkpoints of Llama 2 / 3.x and their fine-tunes, and ``MistralConfig`` (the same
architecture; mlx-lm maps ``mistral`` to its ``llama`` module too). Defaults are transformers':
``rope_theta`` 10,000, ``rms_norm_eps`` 1e-6, ``max_position_embeddings`` 2048, no biases.

The checks every family shares (types, :data:`~models._checkpoint.LIMITS`, the quantization
block, EOS ids, file containment and size caps) come from :mod:`models._checkpoint`; a bad
value raises ``ValueError`` naming the file and the field, a missing required field
:class:`~models._checkpoint.MissingFieldError` (a KeyError and a ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .._checkpoint import (MissingFieldError, QuantSpec, Quantization, bool_field, decoder_fields, float_field,
                           int_field, optional, read_config_files, show)

__all__ = ["LlamaConfig", "MissingFieldError", "QuantSpec", "Quantization", "RopeScaling", "config_from_dict",
           "read_config"]

MODEL_TYPES = ("llama", "mistral")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
#: RoPE scaling types this family runs (mlx-lm's ``initialize_rope``: "default", "linear", "llama3").
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeScaling:
    """A ``rope_scaling`` block that changes RoPE.

    ``"linear"``: positions divided by ``factor``. ``"llama3"`` (Llama 3.1 / 3.2 / 3.3): each
    frequency's wavelength is compared with ``original_max_position_embeddings``: longer than
    ``/ low_freq_factor`` -> divided by ``factor``; shorter than ``/ high_freq_factor`` -> kept;
    in between -> interpolated (:func:`models.llama.model.rope_frequencies`).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture fields of a Llama checkpoint (all lengths in tokens).

    ``tie_word_embeddings`` None means config.json does not say: the loader then ties the head
    to the embedding exactly when the checkpoint stores no ``lm_head.weight`` (transformers'
    default is untied, mlx-lm's tied; the tensors settle it), and its State holds the result.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    rope_traditional: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Quantization | None = None
    model_type: str = "llama"


def _rope_scaling(block: Any, where: str, name: str) -> RopeScaling | None:
    """``rope_scaling`` (or transformers 5's ``rope_parameters``): None for plain RoPE."""
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise ValueError(f"{where}: {name} must be an object, got {show(block)}")
    kind = block.get("type") or block.get("rope_type") or "default"  # mlx-lm's initialize_rope reads both
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}: {name} type {show(kind)} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if kind == "default":
        return None
    if "factor" not in block:
        raise MissingFieldError(f"{where}: missing field {name}.factor (rope type {kind!r})")
    factor = float_field(block["factor"], where, f"{name}.factor", 0.0, 1e6)
    if kind == "linear":
        return RopeScaling("linear", factor)
    low = float_field(optional(block, "low_freq_factor", 1.0), where, f"{name}.low_freq_factor", 0.0, 1e6)
    high = float_field(optional(block, "high_freq_factor", 4.0), where, f"{name}.high_freq_factor", 0.0, 1e6)
    if not high > low:
        raise ValueError(f"{where}: {name}.high_freq_factor ({high:g}) must exceed low_freq_factor ({low:g})")
    original = int_field(optional(block, "original_max_position_embeddings", 8192), where,
                         f"{name}.original_max_position_embeddings", 1, 2**24)
    return RopeScaling("llama3", factor, low, high, original)


def config_from_dict(raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                     where: str = "config.json") -> LlamaConfig:
    """Build a :class:`LlamaConfig` from parsed config.json (and generation_config.json).

    Raises ValueError naming the field for an architecture other than Llama / Mistral, a
    ``hidden_act`` other than silu, a RoPE scaling other than those of
    :data:`SUPPORTED_ROPE_TYPES` (or one with bad factors), sliding-window attention
    (``layer_types`` with other than full attention; Mistral's ``sliding_window`` shorter
    than ``max_position_embeddings``), a bias flag that is not a bool, and every check of
    :func:`models._checkpoint.decoder_fields` (sizes, heads, head_dim, eps, ids, quantization);
    :class:`MissingFieldError` (a KeyError and a ValueError) naming a missing required field.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    _check_architecture(raw, model_type, where)
    fields = decoder_fields(raw, generation, where, max_position_embeddings=2048, rms_norm_eps=1e-6)
    scaling, rope_theta = _rope(raw, where)
    _check_full_attention(raw, model_type, fields, where)
    tie = raw.get("tie_word_embeddings")
    return LlamaConfig(
        **fields,
        rope_theta=float_field(rope_theta, where, "rope_theta", 1.0, 1e15, lo_open=False),
        rope_scaling=scaling,
        rope_traditional=bool_field(optional(raw, "rope_traditional", False), where, "rope_traditional"),
        attention_bias=bool_field(optional(raw, "attention_bias", False), where, "attention_bias"),
        mlp_bias=bool_field(optional(raw, "mlp_bias", False), where, "mlp_bias"),
        tie_word_embeddings=None if tie is None else bool_field(tie, where, "tie_word_embeddings"),
        model_type=model_type if model_type in MODEL_TYPES else "llama",
    )


def _check_architecture(raw: Mapping[str, Any], model_type: Any, where: str) -> None:
    """ValueError unless the config is a Llama / Mistral one with a SwiGLU (silu) MLP."""
    arch = optional(raw, "architectures", [])
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise ValueError(f"{where}: architectures must be a list of strings, got {show(arch)}")
    if model_type not in MODEL_TYPES and not any(a in SUPPORTED_ARCHITECTURES for a in arch):
        raise ValueError(
            f"{where}: unsupported architecture (model_type={show(model_type)}, architectures={show(arch)}); "
            f"the llama family runs {', '.join(MODEL_TYPES)} ({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden_act = optional(raw, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {show(hidden_act)} is not supported (only silu: SwiGLU)")


def _rope(raw: Mapping[str, Any], where: str) -> tuple[Any, Any]:
    """``(rope scaling, rope_theta)`` from ``rope_scaling`` / ``rope_theta`` or transformers 5's
    ``rope_parameters`` (ValueError when both are given and disagree)."""
    rope_parameters = raw.get("rope_parameters")
    if rope_parameters is not None and not isinstance(rope_parameters, Mapping):
        raise ValueError(f"{where}: rope_parameters must be an object, got {show(rope_parameters)}")
    scaling = _rope_scaling(raw.get("rope_scaling"), where, "rope_scaling")
    parameters = _rope_scaling(rope_parameters, where, "rope_parameters")
    if raw.get("rope_scaling") is None:
        scaling = parameters
    elif parameters is not None and parameters != scaling:
        raise ValueError(f"{where}: rope_scaling {show(raw['rope_scaling'])} and rope_parameters "
                         f"{show(rope_parameters)} disagree")
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:
        rope_theta = (rope_parameters or {}).get("rope_theta", DEFAULT_ROPE_THETA)
    return scaling, rope_theta


def _check_full_attention(raw: Mapping[str, Any], model_type: Any, fields: Mapping[str, Any], where: str) -> None:
    """ValueError for sliding-window attention (``layer_types``, Mistral's ``sliding_window``)."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != fields["num_hidden_layers"]
                or not all(t == "full_attention" for t in layer_types)):
            raise ValueError(f"{where}: layer_types must list 'full_attention' for each of the "
                             f"{fields['num_hidden_layers']} layers (sliding-window attention is not "
                             f"supported), got {show(layer_types)}")
    window = raw.get("sliding_window")
    if model_type == "mistral" and window is not None:
        window = int_field(window, where, "sliding_window", 1, 2**31)
        if window < fields["max_position_embeddings"]:
            raise ValueError(f"{where}: sliding_window {window} (shorter than max_position_embeddings "
                             f"{fields['max_position_embeddings']}): sliding-window attention is not supported")


def read_config(path: str | Path) -> LlamaConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, its
    ``eos_token_id`` list wins over config.json's) from a checkpoint directory.

    Raises FileNotFoundError naming config.json when it is missing; ValueError naming the
    file (and the field) when either is unreadable, not a JSON object, too large, a symlink
    out of the directory, or holds a bad value.
    """
    raw, generation, where = read_config_files(path)
    return config_from_dict(raw, generation, where=where)
