"""Qwen3 (``model_type`` "qwen3", ``Qwen3ForCausalLM``): the pre-norm decoder with a per-head
RMSNorm of q and k before RoPE (``q_norm`` / ``k_norm``), plain split-half RoPE (``rope_theta``
1,000,000), a tied head (Qwen3-0.6B to 4B) or a separate one. Architecture: Qwen3 technical report
(arXiv:2505.09388) / transformers ``Qwen3Model``; parity reference mlx-lm's ``mlx_lm/models/qwen3.py``.

Field names and defaults follow transformers' ``Qwen3Config`` as shipped in mlx-community /
lmstudio-community MLX checkpoints. On MLX's CUDA build its decode runs through the fused kernels
(:class:`models.decoder.decode_backends.FusedDecode`: the q/k norm is folded into the attention kernel).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...serving._json import JSON, JSONObject
from .._checkpoint import bool_field, decoder_fields, optional, show
from ..config import DecoderConfig, check_architecture, rope_config
from ...tokenization import data_path

__all__ = ["PRESETS", "checkpoint_config", "config_from_dict"]

MODEL_TYPES = ("qwen3",)
ARCHITECTURES = ("Qwen3ForCausalLM",)
#: Qwen3 ships rope_theta = 1,000,000 (not the 10,000 RoPE default).
DEFAULT_ROPE_THETA = 1_000_000.0
#: Seeded-checkpoint shapes. "0.6b" is the shape of Qwen3-0.6B (its config.json).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


def config_from_dict(raw: JSONObject, generation: Mapping[str, JSON] | None = None,
                     where: str = "config.json") -> DecoderConfig:
    """A :class:`DecoderConfig` (``qk_norm`` on) from parsed config.json (and generation_config.json).

    Raises ValueError naming the field for an architecture other than Qwen3, any RoPE scaling
    (the family runs plain RoPE), and every check of :func:`models._checkpoint.decoder_fields`
    and :func:`models.config.rope_config`; :class:`~models._checkpoint.MissingFieldError` naming
    a missing required field.
    """
    check_architecture(raw, where, "qwen3", MODEL_TYPES, ARCHITECTURES)
    fields = decoder_fields(raw, generation, where, max_position_embeddings=40960, rms_norm_eps=1e-6)
    rope_theta, scaling = rope_config(raw, where, DEFAULT_ROPE_THETA)
    if scaling is not None:
        name = "rope_scaling" if raw.get("rope_scaling") is not None else "rope_parameters"
        raise ValueError(f"{where}: {name} {show(raw[name])} is not supported (the qwen3 family runs plain RoPE)")
    bias = bool_field(optional(raw, "attention_bias", False), where, "attention_bias")
    return DecoderConfig(
        **fields, model_type="qwen3", rope_theta=rope_theta, qk_norm=True, attention_bias=bias, o_proj_bias=bias,
        tie_word_embeddings=bool_field(optional(raw, "tie_word_embeddings", False), where, "tie_word_embeddings"),
    )


def checkpoint_config(preset: str) -> dict[str, Any]:
    """config.json of a seeded ``preset`` checkpoint: the shipped Qwen3-0.6B MLX 4-bit config
    (tokenization package data) with the preset's shape."""
    cfg = json.loads(data_path("config.qwen3-0.6b-mlx-4bit.json").read_text())
    cfg.update(PRESETS[preset])
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg
