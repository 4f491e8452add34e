"""Speculative decoding inside continuous batching (docs/generation.md, "Speculative decoding").

A decoding row that the :class:`~.speculator.Speculator` picks gets the k draft tokens that pay
most for the step (:func:`~.choice.draft_lengths`: expected emitted tokens per second, from its
:class:`~.adaptive.SpecState`'s acceptance estimate, for n-gram drafts also measured on its plainly
decoded tokens, and the measured cost of a step by its rows, :class:`~.cost.StepCosts`), from the
:class:`~.ngram.NgramProposer` (prompt lookup over its own prompt and output) or the
:class:`~.draft.DraftModel` (a second model with its own paged KV); the scheduler plans
it as a k+1-token verify span in the step's ragged forward; the runner samples every position of
the span with the row's own sampler chain and accepts the longest prefix of drafts that the
samples reproduce, plus the sample after it (:func:`~.verify.accepted`; a draft model's sampled
rows are first resampled by the general rejection rule, :func:`~.verify.rejection_tokens`). The
:class:`~.speculator.Speculator` ties proposals, each row's adaptive state and the counters
(:class:`~.stats.SpecStats`) together.
"""

from .adaptive import SpecState
from .choice import Odds, draft_lengths
from .cost import StepCosts
from .draft import DraftModel, DraftModelError
from .ngram import NgramProposer
from .speculator import Speculator, load_draft
from .stats import SPEC_COUNTERS, SpecStats
from .verify import accepted

__all__ = ["SPEC_COUNTERS", "DraftModel", "DraftModelError", "NgramProposer", "Odds", "SpecState", "SpecStats",
           "Speculator", "StepCosts", "accepted", "draft_lengths", "load_draft"]
