"""The engine's one speculation object: which rows speculate, their drafts and the counters."""

from __future__ import annotations

import numpy as np

from ..config import SpeculativeConfig
from ..sampling import SamplingParams
from .adaptive import SpecState
from .ngram import NgramProposer
from .stats import SpecStats

__all__ = ["Speculator"]

_EMPTY = np.zeros(0, dtype=np.int32)


class Speculator:
    """Drafts for the rows of an engine built with ``config`` (its ``method`` is "ngram")."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(config.num_speculative_tokens)

    def new_state(self, params: SamplingParams) -> SpecState | None:
        """A new row's speculation, or None for a row that never speculates: one with penalties
        (their counts would have to follow each draft position on the device), a grammar (its
        matcher would have to advance through the drafts) or logprobs. Every other option
        (temperature, top-k/p, min-p, logit_bias, min_tokens, seeds) is exact under speculation."""
        if (params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
                or params.grammar is not None or params.logprobs is not None):
            return None
        return SpecState(self.config.num_speculative_tokens)

    def draft(self, state: SpecState, tokens: np.ndarray, limit: int) -> np.ndarray:
        """A ready row's draft for this step (``(d,) int32``, d <= min(its k, ``limit``); empty: it
        decodes plainly), from its stream ``tokens`` (prompt + output, all on the host). A step
        without one is a miss (:meth:`SpecState.miss`), unless ``limit`` < 1."""
        if limit < 1:
            return _EMPTY
        out = self.proposer.propose(tokens, min(state.k, limit))
        if not out.size:
            state.miss()
        return out

    def record(self, state: SpecState, drafted: int, accepted: int) -> None:
        """A row's verify outcome: its adaptive state and the counters."""
        state.observe(drafted, accepted)
        self.stats.record(drafted, accepted)
