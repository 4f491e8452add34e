"""``TokenEvent`` and ``PromptEvent``: what the text-generation backend sends to the client-side transducer."""

from __future__ import annotations

from typing import NamedTuple

from ..generation.events import FinishReason

__all__ = ["PromptEvent", "PromptToken", "TokenEvent"]


class TokenEvent(NamedTuple):
    """One new token of a row, from the executor thread (or a pool worker) to the caller.

    ``token_id``: the generated id (an EOS included). ``elapsed_ms``: milliseconds from the row's
    admission into the engine to the moment this token reached the host. ``finish_reason``: set on
    the row's last event only (STOP: EOS or a completed grammar; LENGTH: max_new_tokens).
    ``logprob``: natural-log probability of ``token_id`` and ``top_logprobs``: the most probable
    ``(token_id, logprob)`` pairs, descending (``SamplingParams.logprobs`` of them), both from the
    engine's :class:`SeqEvent` and set only when the row asked for logprobs (processed logits:
    after penalties, logit_bias and masks, before temperature and top-k/p/min-p;
    docs/generation.md). Picklable (it crosses the ServingPool wire); immutable. A named tuple:
    one is made per token on the engine's thread, ~0.25 us against ~0.6 us for a frozen
    dataclass (CPython 3.11; bench/serving_step_overhead.py). ``cached_tokens``: the engine's,
    on the row's first event (prompt tokens that hit the prefix cache).
    """

    token_id: int
    elapsed_ms: float
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int | None = None


class PromptToken(NamedTuple):
    """Prompt token ``i >= 1``: its id, natural-log probability given tokens ``< i`` (float) and
    the ``top`` most probable ``(token_id, logprob)`` pairs at that position, descending (tokens
    at -inf left out)."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


class PromptEvent(NamedTuple):
    """A row's prompt log-probabilities, its first event (before any :class:`TokenEvent`).

    ``tokens``: one :class:`PromptToken` per prompt token after the first (the first has no
    context); ``first``: the prompt's first token id. ``finish_reason``: LENGTH when the row
    generates nothing (``max_new_tokens`` 0: the row ends with this event), else None.
    Picklable (it crosses the ServingPool wire)."""

    first: int
    tokens: tuple[PromptToken, ...]
    finish_reason: FinishReason | None = None
