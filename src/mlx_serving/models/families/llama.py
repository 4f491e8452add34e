"""Llama (``model_type`` "llama", ``LlamaForCausalLM``: Llama 2 / 3.x and fine-tunes) and Mistral
("mistral", ``MistralForCausalLM``: the same architecture; mlx-lm maps it to its llama module too):
the pre-norm decoder without q/k norm, optional ``attention_bias`` (q/k/v/o_proj) and ``mlp_bias``,
RoPE split-half unless ``rope_traditional`` with the "llama3" or "linear" ``rope_scaling``, a tied
or separate head. Architecture: transformers ``LlamaModel``; parity reference mlx-lm's
``mlx_lm/models/llama.py``.

Defaults are transformers' ``LlamaConfig``: ``rope_theta`` 10,000, ``rms_norm_eps`` 1e-6,
``max_position_embeddings`` 2048, no biases; ``tie_word_embeddings`` absent: the tensors settle it
(transformers' default is untied, mlx-lm's tied).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...serving._json import JSON, JSONObject
from .._checkpoint import bool_field, decoder_fields, int_field, optional
from ..config import DecoderConfig, check_architecture, check_full_attention, rope_config

__all__ = ["LLAMA3_ROPE_SCALING", "PRESETS", "checkpoint_config", "config_from_dict"]

MODEL_TYPES = ("llama", "mistral")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DEFAULT_ROPE_THETA = 10_000.0
#: Seeded-checkpoint shapes. "1b" is the shape of Llama-3.2-1B (its config.json; vocabulary aside).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # head_dim 16 (hidden / heads)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}
#: Llama 3.1 / 3.2's ``rope_scaling`` block (3.2's factor).
LLAMA3_ROPE_SCALING: dict[str, Any] = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def config_from_dict(raw: JSONObject, generation: Mapping[str, JSON] | None = None,
                     where: str = "config.json") -> DecoderConfig:
    """A :class:`DecoderConfig` from parsed config.json (and generation_config.json).

    Raises ValueError naming the field for an architecture other than Llama / Mistral, a
    ``hidden_act`` other than silu, an unsupported RoPE scaling (:func:`models.config.rope_config`),
    sliding-window attention (``layer_types`` with other than full attention; Mistral's
    ``sliding_window`` shorter than ``max_position_embeddings``), a bias flag that is not a bool,
    and every check of :func:`models._checkpoint.decoder_fields`;
    :class:`~models._checkpoint.MissingFieldError` naming a missing required field.
    """
    check_architecture(raw, where, "llama", MODEL_TYPES, ARCHITECTURES)
    model_type = raw.get("model_type")
    fields = decoder_fields(raw, generation, where, max_position_embeddings=2048, rms_norm_eps=1e-6)
    rope_theta, scaling = rope_config(raw, where, DEFAULT_ROPE_THETA)
    check_full_attention(raw, where, fields["num_hidden_layers"])
    if model_type == "mistral":
        _check_mistral_window(raw, where, fields["max_position_embeddings"])
    bias = bool_field(optional(raw, "attention_bias", False), where, "attention_bias")
    tie = raw.get("tie_word_embeddings")
    return DecoderConfig(
        **fields,
        model_type=model_type if model_type in MODEL_TYPES else "llama",
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rope_traditional=bool_field(optional(raw, "rope_traditional", False), where, "rope_traditional"),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bool_field(optional(raw, "mlp_bias", False), where, "mlp_bias"),
        tie_word_embeddings=None if tie is None else bool_field(tie, where, "tie_word_embeddings"),
    )


def _check_mistral_window(raw: Mapping[str, Any], where: str, max_positions: int) -> None:
    """ValueError for a Mistral ``sliding_window`` shorter than the context (Mistral 7B v0.1)."""
    window = raw.get("sliding_window")
    if window is None:
        return
    window = int_field(window, where, "sliding_window", 1, 2**31)
    if window < max_positions:
        raise ValueError(f"{where}: sliding_window {window} (shorter than max_position_embeddings "
                         f"{max_positions}): sliding-window attention is not supported")


def checkpoint_config(preset: str) -> dict[str, Any]:
    """config.json of a seeded ``preset`` checkpoint: Llama 3.2's fields (``rope_theta`` 500,000,
    its "llama3" block) with the preset's shape, and the Qwen tokenizer's vocabulary and BOS / EOS
    ids (the writer ships that tokenizer)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING), "rope_theta": 500000.0, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151936,
    }
    cfg.update(PRESETS[preset])
    return cfg
