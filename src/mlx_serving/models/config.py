"""The decoder configuration every family builds from its config.json, and the config checks the
families share (architecture names, RoPE blocks, full attention).

A family (``models/families/<name>.py``) reads config.json through these helpers and the typed
accessors of :mod:`models._checkpoint` into one :class:`DecoderConfig`, whose hook fields (q/k
norm, biases, RoPE variant and scaling, tied head) the shared decoder (:mod:`models.decoder.layers`), the
generic loader (:mod:`models.loader`) and the seeded checkpoint writer
(:mod:`models.seeded_checkpoint`) follow. Errors name the file and the field: ``ValueError`` for
a bad value, :class:`~models._checkpoint.MissingFieldError` (a KeyError and a ValueError) for a
missing required one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..serving._json import JSON
from ._checkpoint import MissingFieldError, Quantization, float_field, int_field, optional, show

__all__ = ["DecoderConfig", "RopeScaling", "check_architecture", "check_full_attention", "rope_config"]

#: RoPE scaling types the decoder runs (mlx-lm's ``initialize_rope``: "default", "linear", "llama3").
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A ``rope_scaling`` block that changes RoPE.

    ``"linear"``: positions divided by ``factor``. ``"llama3"`` (Llama 3.1 / 3.2 / 3.3): each
    frequency's wavelength is compared with ``original_max_position_embeddings``: longer than
    ``/ low_freq_factor`` -> divided by ``factor``; shorter than ``/ high_freq_factor`` -> kept;
    in between -> interpolated (:func:`models.decoder.layers.rope_frequencies`).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class DecoderConfig:
    """Architecture fields of a pre-norm decoder checkpoint (all lengths in tokens) and the hooks
    a family sets: ``qk_norm`` (per-head RMSNorm of q and k before RoPE, Qwen3),
    ``attention_bias`` (biases on q/k/v_proj), ``o_proj_bias``, ``mlp_bias`` (on gate/up/down),
    ``rope_scaling`` / ``rope_traditional`` (the RoPE variant), ``tie_word_embeddings``.

    ``tie_word_embeddings`` None means config.json does not say and the family has no default:
    the loader then ties the head exactly when the checkpoint stores no ``lm_head.weight`` and its
    State holds the result. ``model_type`` is config.json's (``"mistral"`` for a Mistral checkpoint
    of the llama family).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    model_type: str
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rope_traditional: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Quantization | None = None


def check_architecture(raw: JSON, where: str, family: str, model_types: tuple[str, ...],
                       architectures: tuple[str, ...]) -> None:
    """ValueError unless ``raw`` is a JSON object whose ``model_type`` is one of ``model_types``
    or whose ``architectures`` name one of ``architectures``, and whose ``hidden_act`` (default
    silu) is silu (the SwiGLU MLP)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    arch = optional(raw, "architectures", [])
    model_type = raw.get("model_type")
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise ValueError(f"{where}: architectures must be a list of strings, got {show(arch)}")
    if model_type not in model_types and not any(a in architectures for a in arch):
        raise ValueError(
            f"{where}: unsupported architecture (model_type={show(model_type)}, architectures={show(arch)}); "
            f"the {family} family runs {', '.join(model_types)} ({', '.join(architectures)})"
        )
    hidden_act = optional(raw, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {show(hidden_act)} is not supported (only silu: SwiGLU)")


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


def rope_config(raw: Mapping[str, Any], where: str, default_theta: float) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope scaling)`` from ``rope_theta`` / ``rope_scaling`` or transformers 5's
    ``rope_parameters`` (``rope_theta`` and the scaling fields in one object). ValueError for a
    scaling type other than :data:`SUPPORTED_ROPE_TYPES`, bad factors, a ``rope_theta`` not finite
    or below 1, or a ``rope_scaling`` and ``rope_parameters`` that disagree."""
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
    theta = raw.get("rope_theta")
    if theta is None:
        theta = (rope_parameters or {}).get("rope_theta", default_theta)
    return float_field(theta, where, "rope_theta", 1.0, 1e15, lo_open=False), scaling


def check_full_attention(raw: Mapping[str, Any], where: str, num_hidden_layers: int) -> None:
    """ValueError when ``layer_types`` lists other than full attention for each layer
    (sliding-window attention is not implemented)."""
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return
    if (not isinstance(layer_types, list) or len(layer_types) != num_hidden_layers
            or not all(t == "full_attention" for t in layer_types)):
        raise ValueError(f"{where}: layer_types must list 'full_attention' for each of the "
                         f"{num_hidden_layers} layers (sliding-window attention is not "
                         f"supported), got {show(layer_types)}")
