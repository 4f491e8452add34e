"""What the generation core needs of a loaded model, whatever its family, and of a token
constraint (typing only).

``models.loader.load`` returns a state satisfying :class:`ModelState` (a ``models.layers.State``,
whatever the family), over which the shared decoder ``models.layers.forward`` runs. Structured output plugs in
through :data:`ConstraintFactory` (``Engine(..., constraint_factory=)``), making one
:class:`TokenConstraint` per sequence whose ``SamplingParams.grammar`` is set.
"""

from __future__ import annotations

from typing import Callable, Protocol

import mlx.core as mx
import numpy as np

__all__ = ["ConstraintFactory", "ModelConfig", "ModelState", "TokenConstraint"]


class ModelConfig(Protocol):
    """The dimensions the KV cache and the sampler are sized by, and the model's EOS ids
    (read-only: a family's config is a frozen dataclass)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class ModelState(Protocol):
    """A loaded model: its config and its activation (KV) dtype (read-only)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def dtype(self) -> mx.Dtype: ...


class TokenConstraint(Protocol):
    """One sequence's constrained-decoding state (a grammar matcher).

    ``allowed()``: ``(vocab_size,)`` bool, the tokens allowed next (the EOS ids included when the
    grammar may end here); the engine masks the row's logits to them before sampling.
    ``accept(token_id)``: advance by the sampled token (called when it reaches the host).
    ``is_stopped()``: the grammar is complete; the engine ends the sequence (finish "stop").
    """

    def allowed(self) -> np.ndarray: ...
    def accept(self, token_id: int) -> None: ...
    def is_stopped(self) -> bool: ...


#: ``(params.grammar, params.eos_token_ids) -> a fresh TokenConstraint``; raises ValueError for a
#: grammar it cannot use (``Engine.add`` lets it through to the caller).
ConstraintFactory = Callable[[str, tuple[int, ...]], TokenConstraint]
