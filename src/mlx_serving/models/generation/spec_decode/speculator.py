"""The engine's one speculation object: which rows speculate, their drafts and the counters."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...decoder.layers import State
from ..config import SpeculativeConfig
from ..sampling import SamplingParams
from .adaptive import SpecState
from .draft import DraftModel, DraftRow
from .ngram import NgramProposer
from .stats import SpecStats

__all__ = ["MIN_RATE", "Speculator", "load_draft"]


#: Fewest accepted tokens per draft (a row's rate) for a row to propose: a lone verify costs about
#: two plain steps (a k+1-token ragged row, and the row's last token lands first).
MIN_RATE = 1.0


class Speculator:
    """Drafts for the rows of an engine built with ``config``: n-gram prompt lookup ("ngram"), or
    ``draft`` ("draft_model": :meth:`build` loads it). ``eager`` (False; set it to change): every
    row that speculates proposes at each of its decode steps (vLLM's way: a loss where drafts fail;
    tests set it to verify all the time), else rows propose on evidence (:meth:`choose`): for
    n-gram drafts the free evidence of :meth:`witness`; a draft model's rows start trusted (its
    drafts cost a draft forward, so there is no free evidence) and keep proposing while their
    verifies keep their rate."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"a Speculator for method {config.method!r} needs "
                             f"{'a' if config.method == 'draft_model' else 'no'} DraftModel")
        self.config, self.eager = config, False
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_model = draft
        self.stats = SpecStats(config.num_speculative_tokens)

    @classmethod
    def build(cls, config: SpeculativeConfig, draft: State | None, num_blocks: int, block_size: int) -> Speculator:
        """The speculator of ``config``; for "draft_model" over the ``draft`` model
        (:func:`load_draft`) with a KV pool of ``num_blocks`` blocks of ``block_size`` tokens (as
        many as the target's)."""
        return cls(config, DraftModel(draft, num_blocks, block_size) if draft is not None else None)

    def new_state(self, params: SamplingParams) -> SpecState | None:
        """A new row's speculation, or None for a row that never speculates: one with penalties
        (their counts would have to follow each draft position on the device), a grammar (its
        matcher would have to advance through the drafts) or logprobs. Every other option
        (temperature, top-k/p, min-p, logit_bias, min_tokens, seeds) is exact under speculation."""
        if (params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
                or params.grammar is not None or params.logprobs is not None):
            return None
        k = self.config.num_speculative_tokens
        return SpecState(k, rate=float(k) if self.draft_model is not None else 0.0)

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

    def drafts(self, rows: Sequence[tuple[DraftRow, int]]) -> list[np.ndarray]:
        """The picked rows' drafts for this step (``(d,) int32`` each, d <= min(the row's k,
        its ``limit``); empty: it decodes plainly), for ``rows`` ``(row, limit)`` whose last
        tokens are on the host: n-gram lookups over each row's stream, or one batched draft-model
        proposal. A row without one counts as no draft (:meth:`SpecState.no_draft`), unless its limit < 1."""
        ks = [min(_spec(row).k, limit) for row, limit in rows]
        if self.draft_model is not None:
            out = self.draft_model.propose([(row, k) for (row, _), k in zip(rows, ks)])
        else:
            out = [self.proposer.propose(row.tokens(), k) for (row, _), k in zip(rows, ks)]
        for (row, limit), draft in zip(rows, out):
            if limit >= 1 and not draft.size:
                _spec(row).no_draft()
        return out

    def release(self, row: DraftRow) -> None:
        """``row`` left its batch row (finished, cancelled, preempted): its draft blocks are freed."""
        if self.draft_model is not None:
            self.draft_model.release(row)

    def close(self) -> None:
        """Drop the draft model's KV cache (the engine is closing)."""
        if self.draft_model is not None:
            self.draft_model.close()

    def witness(self, state: SpecState, token: int, tokens: Callable[[], np.ndarray]) -> None:
        """A token the row decoded plainly landed (``tokens()``: its stream, prompt + output, this
        token last): check it against the row's shadow draft, and when that is settled make the
        next one (:meth:`SpecState.witness`), free evidence for the row's rate (n-gram drafts only)."""
        if self.draft_model is None and state.witness(token):
            state.shadow = self.proposer.propose(tokens(), state.k_max)
            if not state.shadow.size:
                state.no_draft()

    def record(self, state: SpecState, drafted: int, accepted: int) -> None:
        """A row's verify outcome: its adaptive state and the counters."""
        state.observe(drafted, accepted)
        self.stats.record(drafted, accepted)


def load_draft(config: SpeculativeConfig | None, target: State) -> State | None:
    """The draft model of a "draft_model" ``config`` for the ``target`` model, loaded
    (:meth:`~.draft.DraftModel.load_state`); None for any other config. Raises
    :class:`~.draft.DraftModelError` (a ValueError naming ``speculative_config.model``) when it
    cannot be loaded or does not share the target's tokenizer."""
    if config is None or config.method != "draft_model" or config.model is None:
        return None
    return DraftModel.load_state(config.model, target)


def _spec(row: DraftRow) -> SpecState:
    if row.spec is None:
        raise ValueError("a row without speculation state was asked for a draft")
    return row.spec
