"""Qwen2 / Qwen2.5 (``model_type`` "qwen2", ``Qwen2ForCausalLM``): the pre-norm decoder with
biases on the q/k/v projections (none on o_proj or the MLP), no q/k norm, plain split-half RoPE
(or a "linear" / "llama3" ``rope_scaling`` block, as mlx-lm's ``initialize_rope``), a tied head
(Qwen2.5-0.5B to 3B) or a separate one. Architecture: transformers ``Qwen2Model``; parity
reference mlx-lm's ``mlx_lm/models/qwen2.py``.

Defaults are transformers' ``Qwen2Config`` (5.x): ``rope_theta`` 10,000 (mlx-lm's ``ModelArgs``
says 1,000,000; shipped configs set it), ``rms_norm_eps`` 1e-6, ``max_position_embeddings``
32,768, ``tie_word_embeddings`` absent: the tensors settle it (tied exactly when no
``lm_head.weight`` is stored). Sliding-window attention (``use_sliding_window`` true) is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...serving._json import JSON, JSONObject
from .._checkpoint import bool_field, decoder_fields, optional
from ..config import DecoderConfig, check_architecture, check_full_attention, rope_config

__all__ = ["PRESETS", "checkpoint_config", "config_from_dict"]

MODEL_TYPES = ("qwen2",)
ARCHITECTURES = ("Qwen2ForCausalLM",)
DEFAULT_ROPE_THETA = 10_000.0  # transformers' Qwen2Config
#: Seeded-checkpoint shapes. "0.5b" is the shape of Qwen2.5-0.5B (its config.json).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # head_dim 16 (hidden / heads)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}


def config_from_dict(raw: JSONObject, generation: Mapping[str, JSON] | None = None,
                     where: str = "config.json") -> DecoderConfig:
    """A :class:`DecoderConfig` (``attention_bias`` on q/k/v only) from parsed config.json (and
    generation_config.json).

    Raises ValueError naming the field for an architecture other than Qwen2, ``use_sliding_window``
    true or ``layer_types`` with other than full attention (sliding-window attention is not
    implemented), and every check of :func:`models._checkpoint.decoder_fields` and
    :func:`models.config.rope_config`; :class:`~models._checkpoint.MissingFieldError` naming a
    missing required field.
    """
    check_architecture(raw, where, "qwen2", MODEL_TYPES, ARCHITECTURES)
    fields = decoder_fields(raw, generation, where, max_position_embeddings=32768, rms_norm_eps=1e-6)
    if bool_field(optional(raw, "use_sliding_window", False), where, "use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is true: sliding-window attention is not supported")
    check_full_attention(raw, where, fields["num_hidden_layers"])
    rope_theta, scaling = rope_config(raw, where, DEFAULT_ROPE_THETA)
    tie = raw.get("tie_word_embeddings")
    return DecoderConfig(
        **fields, model_type="qwen2", rope_theta=rope_theta, rope_scaling=scaling, attention_bias=True,
        tie_word_embeddings=None if tie is None else bool_field(tie, where, "tie_word_embeddings"),
    )


def checkpoint_config(preset: str) -> dict[str, Any]:
    """config.json of a seeded ``preset`` checkpoint: Qwen2.5-0.5B's fields with the preset's
    shape (BOS / EOS ids: the Qwen tokenizer's ``<|endoftext|>`` / ``<|im_end|>``)."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "model_type": "qwen2", "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }
    cfg.update(PRESETS[preset])
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg
