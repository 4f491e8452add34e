"""The engine's one speculation object: which rows speculate, their drafts and the counters."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..config import SpeculativeConfig
from ..sampling import SamplingParams
from .adaptive import SpecState
from .ngram import NgramProposer
from .stats import SpecStats

__all__ = ["MIN_RATE", "Speculator"]

_EMPTY = np.zeros(0, dtype=np.int32)

#: Fewest accepted tokens per draft (a row's rate) for a row to propose: a lone verify costs about
#: two plain steps (a k+1-token ragged row, and the row's last token lands first).
MIN_RATE = 1.0


class Speculator:
    """Drafts for the rows of an engine built with ``config`` (its ``method`` is "ngram").
    ``eager`` (False; set it to change): every row that speculates proposes at each of its decode
    steps (vLLM's way: a loss where drafts fail; tests set it to verify all the time), else rows
    propose on evidence (:meth:`choose`)."""

    def __init__(self, config: SpeculativeConfig):
        self.config, self.eager = config, False
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

    def choose(self, decoding: Sequence[SpecState | None]) -> bool:
        """Pick the rows that propose at the coming step (``go``) among the step's ``decoding``
        rows (None: a row that never speculates); True when any was picked (their last tokens must
        land before the step is planned). The rows whose rate is at least :data:`MIN_RATE` propose
        when their rates sum to at least one more than the rows left to decode plainly: a step
        with verify rows runs a second forward besides the plain rows' decode, which costs about
        a plain step, so the accepted tokens must outnumber the plain rows' one each. ``eager``:
        every row that speculates."""
        floor = 0.0 if self.eager else MIN_RATE
        picked = [s for s in decoding if s is not None and s.rate >= floor]
        go = bool(picked) and (self.eager or sum(s.rate for s in picked) >= len(decoding) - len(picked) + 1)
        for s in decoding:
            if s is not None:
                s.go = go and s.rate >= floor
        return go

    def draft(self, state: SpecState, tokens: np.ndarray, limit: int) -> np.ndarray:
        """A picked row's draft for this step (``(d,) int32``, d <= min(its k, ``limit``); empty: it
        decodes plainly), from its stream ``tokens`` (prompt + output, all on the host). A step
        without one counts as no draft (:meth:`SpecState.no_draft`), unless ``limit`` < 1."""
        if limit < 1:
            return _EMPTY
        out = self.proposer.propose(tokens, min(state.k, limit))
        if not out.size:
            state.no_draft()
        return out

    def witness(self, state: SpecState, token: int, tokens: Callable[[], np.ndarray]) -> None:
        """A token the row decoded plainly landed (``tokens()``: its stream, prompt + output, this
        token last): check it against the row's shadow draft, and when that is settled make the
        next one (:meth:`SpecState.witness`), free evidence for the row's rate."""
        if state.witness(token):
            state.shadow = self.proposer.propose(tokens(), state.k_max)
            if not state.shadow.size:
                state.no_draft()

    def record(self, state: SpecState, drafted: int, accepted: int) -> None:
        """A row's verify outcome: its adaptive state and the counters."""
        state.observe(drafted, accepted)
        self.stats.record(drafted, accepted)
