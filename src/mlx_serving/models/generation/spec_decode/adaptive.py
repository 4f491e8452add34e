"""Per-row speculation statistics: how often a row's drafts hold, on evidence.

A row's outlook (:meth:`SpecState.odds`) is ``alpha``, the acceptance probability of a draft token
(given the ones before it held), and ``reach``, the probability that its proposer has a draft at
all. ``alpha`` is ``hits / (hits + misses + 1)``: accepted draft tokens over those plus the
outcomes that stopped short of the draft's end (the geometric model's estimate, with one miss
assumed, so that one lucky outcome is not trusted), both decayed by ``1 - ALPHA`` per outcome, so
the newest few outcomes count most. The evidence is free for n-gram
drafts: while a row decodes plainly its landed tokens are checked against a *shadow* draft, the one
the proposer would have made (:meth:`SpecState.witness`), exactly as a verify would have checked
it; real verifies add their outcomes. A new n-gram row has no hits (alpha 0): it proposes nothing
until its own tokens show drafts that hold. A draft model's row starts trusted (``hits`` = k).
How many draft tokens a row proposes at a step (``k``, 0 for none) is the speculator's choice
(:func:`~.choice.draft_lengths`) from the outlooks of all rows and the measured step costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .choice import Odds

__all__ = ["ALPHA", "SpecState"]

#: Weight of the newest outcome in a row's statistics (hits and misses decay by ``1 - ALPHA``).
ALPHA = 0.25

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass
class SpecState:
    """One row's speculation: at most ``k_max`` draft tokens; ``k``, the draft tokens of its latest
    pick and ``go``, whether it proposes at the coming step (both set by the speculator's
    choice); ``hits``, ``misses``
    and ``reach`` (above); ``shadow``, the draft its plainly decoded tokens are checked against, of
    which ``seen`` matched so far; ``draft_probs``: the distributions ``(d, V)`` float32 its latest
    draft of d tokens was sampled from (a draft model's, for a sampled row; None: a point-mass
    draft), which its verify reads (:mod:`.verify`)."""

    k_max: int
    k: int = 0
    go: bool = False
    hits: float = 0.0
    misses: float = 0.0
    reach: float = 1.0
    shadow: np.ndarray = field(default_factory=lambda: _EMPTY)
    seen: int = 0
    draft_probs: mx.array | None = field(default=None, compare=False, repr=False)

    @property
    def alpha(self) -> float:
        """A draft token's acceptance probability, estimated (0 without evidence)."""
        return self.hits / (self.hits + self.misses + 1)

    def odds(self) -> Odds:
        """The row's outlook for the speculator's choice."""
        return Odds(self.reach, self.alpha, self.k_max)

    def tick(self) -> bool:
        """The row's decode step is being planned: True when it proposes there (``go``, then
        cleared; it proposes ``k`` draft tokens)."""
        go, self.go = self.go, False
        return go

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify (or a shadow draft) of ``drafted`` tokens (>= 1) accepted ``accepted`` of them;
        the next shadow draft starts afresh."""
        keep = 1 - ALPHA
        self.hits = keep * self.hits + accepted
        self.misses = keep * self.misses + (accepted < drafted)
        self.reach += ALPHA * (1 - self.reach)
        self.shadow, self.seen = _EMPTY, 0

    def no_draft(self) -> None:
        """The proposer found no draft (no n-gram matched)."""
        self.reach -= ALPHA * self.reach

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
