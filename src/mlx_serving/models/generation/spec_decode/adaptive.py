"""Per-row adaptive speculation: evidence first, then drafts, and how many draft tokens.

A verify costs more than the plain step it replaces (a k+1-token row through the ragged forward,
the row's last token landed first: no pipelining), so a row proposes only on evidence that its
drafts are accepted. The evidence is free: while a row decodes plainly its landed tokens are
checked against a *shadow* draft, the one the proposer would have made (:meth:`SpecState.witness`),
exactly as a verify would have checked it; real verifies add their outcomes. ``rate`` is the
moving average (weight :data:`ALPHA` to the newest) of accepted tokens per draft, a step without a
draft (no n-gram matched) counting 0. A new row starts at 0: it proposes nothing until its own
tokens show drafts that hold. Which rows propose at a step is the speculator's choice
(:meth:`~.speculator.Speculator.choose`) from the rates of all rows.

A row's ``k`` (draft tokens next, <= ``k_max``) follows each outcome: one that accepts every draft
raises it by one, one that accepts ``a`` of more sets it to ``a + 1`` (``max(1, k // 2)`` for 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

__all__ = ["ALPHA", "SpecState"]

#: Weight of the newest outcome in a row's rate (accepted tokens per draft).
ALPHA = 0.25

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class SpecState:
    """One row's speculation: ``k`` draft tokens next (<= ``k_max``); ``rate``, its accepted tokens
    per draft (moving average); ``go``: it proposes at the coming step; ``shadow``, the draft its
    plainly decoded tokens are checked against, of which ``seen`` matched so far; ``draft_probs``:
    the distributions ``(d, V)`` float32 its latest draft of d tokens was sampled from (a draft
    model's, for a sampled row; None: a point-mass draft), which its verify reads (:mod:`.verify`)."""

    k_max: int
    k: int = 0
    rate: float = 0.0
    go: bool = False
    shadow: np.ndarray = field(default_factory=lambda: _EMPTY)
    seen: int = 0
    draft_probs: mx.array | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def tick(self) -> bool:
        """The row's decode step is being planned: True when it proposes there (``go``, then
        cleared)."""
        go, self.go = self.go, False
        return go

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify (or a shadow draft) of ``drafted`` tokens (>= 1) accepted ``accepted`` of them;
        the next shadow draft starts afresh."""
        self._note(accepted)
        self.shadow, self.seen = _EMPTY, 0
        if accepted == 0:
            self.k = max(1, self.k // 2)
        else:
            self.k = min(self.k_max, drafted + 1 if accepted == drafted else accepted + 1)

    def no_draft(self) -> None:
        """A step found no draft (no n-gram matched): an outcome of 0 accepted tokens for the rate."""
        self._note(0)

    def witness(self, token: int) -> bool:
        """A token the row decoded plainly landed: True when a new shadow draft is due (none was
        pending, or this token settles the pending one as a verify would: it differs from the
        draft at the next position, or follows the whole draft; the outcome is observed)."""
        if not self.shadow.size:
            return True
        if self.seen < self.shadow.size and int(self.shadow[self.seen]) == token:
            self.seen += 1
            return False
        self.observe(self.shadow.size, self.seen)
        return True

    def _note(self, accepted: int) -> None:
        self.rate += ALPHA * (accepted - self.rate)
