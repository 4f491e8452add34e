"""The engine's one speculation object: which rows speculate, their drafts and the counters."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ...decoder.layers import State
from ..config import SpeculativeConfig
from ..sampling import SamplingParams
from .adaptive import SpecState
from .choice import draft_lengths
from .cost import StepCosts, StepTimer
from .draft import DraftModel, DraftRow
from .ngram import NgramProposer
from .stats import SpecStats

__all__ = ["DRAFT_COSTS", "Speculator", "load_draft"]

#: The draft-model method's fixed step costs (:class:`~.cost.StepCosts` table): a step whose rows
#: are nearly free (1 for one row, 2 for 1024), so its rows propose while their drafts hold at all.
DRAFT_COSTS = {(False, 1): 1.0, (False, 1024): 2.0}


class Speculator:
    """Drafts for the rows of an engine built with ``config``: n-gram prompt lookup ("ngram"), or
    ``draft`` ("draft_model": :meth:`build` loads it). ``eager`` (False; set it to change): every
    row that speculates proposes at each of its decode steps (vLLM's way: a loss where drafts fail;
    tests set it to verify all the time), else each step's draft lengths are the ones that pay
    most (:meth:`choose`) on each row's evidence (for n-gram drafts the free evidence of
    :meth:`witness`; a draft model's rows start trusted: its drafts cost a draft forward, so
    there is no free evidence) and on the step costs (``costs``, measured by ``timer``, which the
    engine drives). A draft model's costs are not measured but fixed (:data:`DRAFT_COSTS`): its
    sampled rows draw more uniforms when they verify, so their choices must not depend on timing
    for a seeded request to reproduce."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None):
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError(f"a Speculator for method {config.method!r} needs "
                             f"{'a' if config.method == 'draft_model' else 'no'} DraftModel")
        self.config, self.eager = config, False
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_model = draft
        self.stats = SpecStats(config.num_speculative_tokens)
        self.costs = StepCosts(dict(DRAFT_COSTS), frozen=True) if draft is not None else StepCosts()
        self.timer = StepTimer(lambda: self.costs)  # ``costs`` may be replaced (tests give theirs)

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
        return SpecState(k, hits=float(k) if self.draft_model is not None else 0.0)

    def choose(self, decoding: Sequence[SpecState | None]) -> bool:
        """Set the draft length ``k`` of each of the step's ``decoding`` rows (None: a row that
        never speculates) and pick those with k > 0 to propose (``go``): the lengths that maximise
        expected emitted tokens per second (:func:`~.choice.draft_lengths`, on the rows' outlooks
        and ``costs``; ``eager``: ``k_max`` each). True when any row was picked (their last tokens
        must land before the step is planned). Each chosen k is counted in ``stats.k_chosen``."""
        if self.eager:
            ks = [s.k_max if s is not None else 0 for s in decoding]
        else:
            ks = draft_lengths([s.odds() if s is not None else None for s in decoding], self.costs)
        for s, k in zip(decoding, ks):
            if s is not None:
                s.k, s.go = k, k > 0
                self.stats.chose(k)
        return any(ks)

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
