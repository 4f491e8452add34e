"""Speculative decoding inside continuous batching (docs/generation.md, "Speculative decoding").

A decoding row that the :class:`~.speculator.Speculator` picks (on evidence: its
:class:`~.adaptive.SpecState`'s rate of accepted tokens per draft, for n-gram drafts also measured
on its plainly decoded tokens) gets up to k draft tokens from the :class:`~.ngram.NgramProposer`
(prompt lookup over its own prompt and output) or the :class:`~.draft.DraftModel` (a second model
with its own paged KV); the scheduler plans
it as a k+1-token verify span in the step's ragged forward; the runner samples every position of
the span with the row's own sampler chain and accepts the longest prefix of drafts that the
samples reproduce, plus the sample after it (:func:`~.verify.accepted`; a draft model's sampled
rows are first resampled by the general rejection rule, :func:`~.verify.rejection_tokens`). The
:class:`~.speculator.Speculator` ties proposals, each row's adaptive state and the counters
(:class:`~.stats.SpecStats`) together.
"""

from .adaptive import SpecState
from .draft import DraftModel, DraftModelError
from .ngram import NgramProposer
from .speculator import Speculator, load_draft
from .stats import SpecStats
from .verify import accepted

__all__ = ["DraftModel", "DraftModelError", "NgramProposer", "SpecState", "SpecStats", "Speculator", "accepted", "load_draft"]
