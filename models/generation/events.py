"""What the generation engine emits: one :class:`SeqEvent` per new token, and why a sequence ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["FinishReason", "SeqEvent"]


class FinishReason(str, enum.Enum):
    """Why a sequence ended. A ``str``: members compare equal to, print as and JSON-encode as
    their value ("stop", "length")."""

    STOP = "stop"  # an EOS token (the engine), or a stop string (the text-generation transducer)
    LENGTH = "length"  # max_new_tokens reached

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """One new token of sequence ``seq_id``.

    ``elapsed_ms``: milliseconds from the sequence's ``Engine.add`` to the moment this token
    reached the host (``time.perf_counter``). ``finish_reason`` is set on the sequence's last
    event only: STOP when ``token_id`` is an EOS id (the EOS is included), LENGTH at
    ``max_new_tokens``.
    """

    seq_id: int
    token_id: int
    elapsed_ms: float
    finish_reason: FinishReason | None = None
