"""Speculation counters, vLLM's ``spec_decode`` metrics: drafts, draft tokens, accepted tokens
and accepted tokens per draft position."""

from __future__ import annotations

__all__ = ["SPEC_COUNTERS", "SpecStats"]

#: The whole-draft counters of :meth:`SpecStats.stats`, vLLM's names: drafts, draft tokens proposed,
#: draft tokens accepted (the acceptance rate is the last over the second).
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class SpecStats:
    """Counters of one engine's verifies with at most ``k_max`` draft tokens each, and
    ``k_chosen[k]``: how many times a speculating decoding row was given k draft tokens at a step
    (0: it decoded plainly; not exported as a metric)."""

    def __init__(self, k_max: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k_max
        self.k_chosen = [0] * (k_max + 1)

    def chose(self, k: int) -> None:
        """A speculating row was given ``k`` (0..k_max) draft tokens for a step."""
        self.k_chosen[k] += 1

    def record(self, drafted: int, accepted: int) -> None:
        """One verify of ``drafted`` tokens whose first ``accepted`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def stats(self) -> dict[str, float]:
        """``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens``,
        ``spec_decode_num_accepted_tokens`` and ``spec_decode_num_accepted_tokens_per_pos_<i>``
        (i from 0): plain counters, so sums over workers stay meaningful."""
        out: dict[str, float] = dict(zip(SPEC_COUNTERS, (self.num_drafts, self.num_draft_tokens,
                                                         self.num_accepted_tokens)))
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_per_pos_{i}"] = n
        return out
