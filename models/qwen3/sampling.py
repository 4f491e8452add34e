"""Token sampling and per-request sampling parameters.

Semantics as in mlx-lm and the OpenAI API: ``temperature == 0`` is greedy decoding (argmax);
``temperature > 0`` samples from the softmax at that temperature, restricted to the nucleus of
``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration": keep the
smallest set of tokens, in order of decreasing probability, whose total probability reaches
``top_p``, the token that crosses it included, renormalize); ``top_p == 1`` is plain temperature
sampling. Sampling runs on the device (:func:`sample_top_p`).

Randomness: each request owns a ``numpy.random.Generator`` seeded from its ``seed``; each sampled
token consumes exactly one uniform draw from it, so a request's tokens do not depend on its
batchmates.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

import mlx.core as mx

__all__ = ["SamplerKind", "SamplingParams", "greedy", "sample_top_p"]


class SamplerKind(enum.Enum):
    """How a sequence's next token is chosen (:attr:`SamplingParams.kind`)."""

    GREEDY = "greedy"  # argmax (temperature 0)
    TOP_P = "top_p"  # nucleus sampling at a temperature > 0 (top_p 1: plain temperature sampling)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options.

    ``max_new_tokens``: an int >= 1 (an EOS counts). ``temperature``: a finite number >= 0,
    0 = greedy. ``top_p``: in (0, 1], used when ``temperature > 0``. ``seed``: an int >= 0 for
    reproducible sampling (None: fresh entropy). ``eos_token_ids``: generation stops after any of
    them. Numbers are stored as int / float. Raises ValueError on construction for any value of
    the wrong type or out of range.
    """

    max_new_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        set_ = object.__setattr__
        set_(self, "max_new_tokens", int(self.max_new_tokens))
        set_(self, "temperature", float(self.temperature))
        set_(self, "top_p", float(self.top_p))
        set_(self, "seed", None if self.seed is None else int(self.seed))
        set_(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def kind(self) -> SamplerKind:
        """GREEDY when ``temperature == 0``, else TOP_P."""
        return SamplerKind.GREEDY if self.temperature == 0 else SamplerKind.TOP_P


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def greedy(logits: mx.array) -> mx.array:
    """``(B, V)`` logits -> ``(B,)`` int32 argmax."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def sample_top_p(logits: mx.array, temperature: mx.array, top_p: mx.array, u: mx.array) -> mx.array:
    """Nucleus sampling on device.

    ``logits`` (B, V); ``temperature``, ``top_p``, ``u`` (B,) float32 with temperature > 0,
    top_p in (0, 1] and ``u`` uniform in [0, 1). Returns (B,) int32 token ids: the first sorted
    token whose cumulative probability exceeds ``u`` times the nucleus mass.
    """
    probs = mx.softmax(logits.astype(mx.float32) / temperature[:, None], axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_p = mx.take_along_axis(probs, order, axis=-1)
    cum = mx.cumsum(sorted_p, axis=-1)
    keep = (cum - sorted_p) < top_p[:, None]  # mass before the token is below top_p
    n_keep = keep.sum(axis=-1)
    mass = mx.take_along_axis(cum, (n_keep - 1)[:, None], axis=-1)[:, 0]
    k = ((cum < (u * mass)[:, None]) & keep).sum(axis=-1)
    k = mx.minimum(k, n_keep - 1)
    return mx.take_along_axis(order, k[:, None], axis=-1)[:, 0].astype(mx.int32)
