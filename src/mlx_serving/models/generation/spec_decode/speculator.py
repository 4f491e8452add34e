"""The engine's one speculation object: which rows speculate, their drafts and the counters."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...decoder.layers import State
from ..config import SpeculativeConfig
from ..sampling import SamplingParams
from .adaptive import SpecState
from .draft import DraftModel, DraftRow
from .ngram import NgramProposer
from .stats import SpecStats

__all__ = ["Speculator", "load_draft"]


class Speculator:
    """Drafts for the rows of an engine built with ``config``: n-gram prompt lookup ("ngram"), or
    ``draft`` ("draft_model": :meth:`build` loads it)."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"a Speculator for method {config.method!r} needs "
                             f"{'a' if config.method == 'draft_model' else 'no'} DraftModel")
        self.config = config
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
        return SpecState(self.config.num_speculative_tokens)

    def drafts(self, rows: Sequence[tuple[DraftRow, int]]) -> list[np.ndarray]:
        """The ready rows' drafts for this step (``(d,) int32`` each, d <= min(the row's k,
        its ``limit``); empty: it decodes plainly), for ``rows`` ``(row, limit)`` whose last
        tokens are on the host: n-gram lookups over each row's stream, or one batched draft-model
        proposal. A row without one is a miss (:meth:`SpecState.miss`), unless its limit < 1."""
        ks = [min(_spec(row).k, limit) for row, limit in rows]
        if self.draft_model is not None:
            out = self.draft_model.propose([(row, k) for (row, _), k in zip(rows, ks)])
        else:
            out = [self.proposer.propose(row.tokens(), k) for (row, _), k in zip(rows, ks)]
        for (row, limit), draft in zip(rows, out):
            if limit >= 1 and not draft.size:
                _spec(row).miss()
        return out

    def release(self, row: DraftRow) -> None:
        """``row`` left its batch row (finished, cancelled, preempted): its draft blocks are freed."""
        if self.draft_model is not None:
            self.draft_model.release(row)

    def close(self) -> None:
        """Drop the draft model's KV cache (the engine is closing)."""
        if self.draft_model is not None:
            self.draft_model.close()

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
