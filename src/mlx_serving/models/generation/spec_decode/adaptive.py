"""Per-row adaptive speculation: how many draft tokens a row proposes, and when it pauses.

A row starts at the configured k. A verify that accepts every draft raises its k by one (up to the
configured k); one that accepts ``a`` < k of them sets k to ``a + 1``; a step with no draft (no
n-gram matched) or none accepted is a miss: after ``m`` misses in a row the row skips the next
``min(2 ** (m - 1), MAX_COOLDOWN)`` steps' proposals, decoding plainly (and pipelined). So a row
whose drafts fail costs at most one wasted verify every :data:`MAX_COOLDOWN` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

__all__ = ["MAX_COOLDOWN", "SpecState"]

#: Most steps a row pauses proposing after repeated misses.
MAX_COOLDOWN = 16


@dataclass
class SpecState:
    """One row's speculation: ``k`` draft tokens next (<= ``k_max``), ``misses`` in a row and the
    ``cooldown`` steps left before it proposes again; ``draft_probs``: the distributions ``(d,
    V)`` float32 its latest draft of d tokens was sampled from (a draft model's, for a sampled
    row; None: a point-mass draft), which its verify reads (:mod:`.verify`)."""

    k_max: int
    k: int = 0
    misses: int = 0
    cooldown: int = 0
    draft_probs: mx.array | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    @property
    def ready(self) -> bool:
        """The row proposes at its next decode step (its last token must be on the host)."""
        return self.cooldown == 0

    def tick(self) -> bool:
        """One decode step: True when the row may propose now, else one cooldown step passes."""
        if self.cooldown:
            self.cooldown -= 1
            return False
        return True

    def miss(self) -> None:
        """No draft this step, or none of it accepted: pause for longer each time in a row."""
        self.misses += 1
        self.cooldown = min(1 << (self.misses - 1), MAX_COOLDOWN)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens accepted ``accepted`` of them."""
        if accepted == 0:
            self.k = max(1, self.k // 2)
            self.miss()
            return
        self.misses = 0
        self.k = min(self.k_max, drafted + 1 if accepted == drafted else accepted + 1)
