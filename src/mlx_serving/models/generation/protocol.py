"""What the generation core needs of a token constraint (typing only): structured output plugs in
through :data:`ConstraintFactory` (``Engine(..., constraint_factory=)``), making one
:class:`TokenConstraint` per sequence whose ``SamplingParams.grammar`` is set.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

__all__ = ["ConstraintFactory", "TokenConstraint"]


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
