"""What the generation core needs of a loaded model, whatever its family (typing only).

A family's ``load`` returns a state satisfying :class:`ModelState`; its ``model`` module (found
through ``models.registry.family_model``) runs the forward pass over it.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import mlx.core as mx

__all__ = ["ModelConfig", "ModelState"]


class ModelConfig(Protocol):
    """The dimensions the KV cache and the sampler are sized by."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


class ModelState(Protocol):
    """A loaded model: its family's package name, its config and its activation (KV) dtype."""

    family: ClassVar[str]
    config: ModelConfig
    dtype: mx.Dtype
