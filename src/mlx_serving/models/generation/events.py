"""What the generation engine emits: one :class:`SeqEvent` per new token, and why a sequence ended."""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["FinishReason", "SeqEvent"]


class FinishReason(str, enum.Enum):
    """Why a sequence ended. A ``str``: members compare equal to, print as and JSON-encode as
    their value ("stop", "length", "cancelled", "tool_calls"), as OpenAI's ``finish_reason``."""

    STOP = "stop"  # an EOS token or a complete grammar (the engine), or a stop string (the text-generation transducer)
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the client stopped the stream (the text-generation layer)
    TOOL_CALLS = "tool_calls"  # the output ended with tool calls (the text-generation layer)

    def __str__(self) -> str:
        return self.value


class SeqEvent(NamedTuple):
    """One new token of sequence ``seq_id`` (immutable; a NamedTuple: ~0.27 us to build against
    ~0.70 us for the frozen dataclass it was, once per token on the engine's thread).

    ``elapsed_ms``: milliseconds from the sequence's ``Engine.add`` to the moment this token
    reached the host (``time.perf_counter``). ``finish_reason`` is set on the sequence's last
    event only: STOP when ``token_id`` is an EOS id (the EOS is included) or the sequence's
    constraint is complete, LENGTH at ``max_new_tokens``.

    Set when the sequence's ``params.logprobs`` is not None (else None): ``logprob``, the natural
    log-probability of ``token_id``, and ``top_logprobs``, the ``params.logprobs`` most probable
    tokens as (token_id, logprob) pairs in descending order. Both come from the processed logits
    (after logit_bias, the min_tokens EOS mask, penalties and constraint masks; before temperature,
    top-k, top-p and min-p), as vLLM's "processed_logprobs" without the temperature. Tokens those
    processors blocked (log-probability ``-inf``) are never among ``top_logprobs``: it holds fewer
    than ``params.logprobs`` pairs when fewer tokens are allowed.

    ``cached_tokens``: on the sequence's first event only, the prompt tokens its first admission
    found in the prefix cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); 0 without
    a hit, None on the slot design (no prefix cache) and on every later event.
    """

    seq_id: int
    token_id: int
    elapsed_ms: float
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    cached_tokens: int | None = None
