"""Token sampling and per-request sampling parameters.

Semantics as in mlx-lm and the OpenAI API: ``temperature == 0`` is greedy decoding (argmax);
``temperature > 0`` samples from the softmax at that temperature, restricted to the nucleus of
``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration": keep the
smallest set of tokens, in order of decreasing probability, whose total probability reaches
``top_p``, the token that crosses it included, renormalize); ``top_p == 1`` is plain temperature
sampling. Sampling runs on the device (:func:`sample_top_p`).

Numerics: a temperature below :data:`MIN_TEMPERATURE` (1e-5) is greedy decoding, like 0. At such a
temperature the softmax is already one-hot in float32 except between logits closer than ~1e-3, and
dividing raw logits by it would overflow (1e-38 gave ``inf / inf`` = NaN probabilities and the last
token id of the vocabulary) or divide by zero (a float64 below ~1.4e-45 is 0 in float32). Above it,
:func:`sample_top_p` subtracts each row's largest logit before dividing, so every scaled logit is
<= 0 and the softmax never sees ``inf``.

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

__all__ = ["MAX_SEED", "MIN_TEMPERATURE", "SamplerKind", "SamplingParams", "greedy", "sample_top_p"]

#: Temperatures below this are greedy decoding (see the module docstring).
MIN_TEMPERATURE = 1e-5
#: Seeds are ints in [0, MAX_SEED): what a 64-bit seed holds.
MAX_SEED = 2**64


class SamplerKind(enum.Enum):
    """How a sequence's next token is chosen (:attr:`SamplingParams.kind`)."""

    GREEDY = "greedy"  # argmax (temperature 0, or below MIN_TEMPERATURE)
    TOP_P = "top_p"  # nucleus sampling at a temperature >= MIN_TEMPERATURE (top_p 1: plain temperature sampling)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options.

    ``max_new_tokens``: an int >= 1 (an EOS counts). ``temperature``: a finite real number >= 0,
    0 (or anything below ``MIN_TEMPERATURE``, 1e-5) = greedy. ``top_p``: a real number in (0, 1],
    used when sampling. ``seed``: an int in [0, 2**64) for reproducible sampling (None: fresh
    entropy). ``bool`` is not a number here (``True`` is refused everywhere). ``eos_token_ids``:
    generation stops after any of them. Numbers are stored as int / float. Raises ValueError on
    construction, naming the option, for any value of the wrong type or out of range.
    """

    max_new_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {_show(self.max_new_tokens)}")
        temperature = _as_float(self.temperature)
        if temperature is None or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {_show(self.temperature)}")
        top_p = _as_float(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {_show(self.top_p)}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {_show(self.seed)}")
        set_ = object.__setattr__
        set_(self, "max_new_tokens", int(self.max_new_tokens))
        set_(self, "temperature", temperature)
        set_(self, "top_p", top_p)
        set_(self, "seed", None if self.seed is None else int(self.seed))
        set_(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def kind(self) -> SamplerKind:
        """GREEDY when ``temperature < MIN_TEMPERATURE`` (0 included), else TOP_P."""
        return SamplerKind.GREEDY if self.temperature < MIN_TEMPERATURE else SamplerKind.TOP_P


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_float(value: object) -> float | None:
    """``value`` as a float when it is a real number (not a bool) that a float holds, else None
    (an int too large for a float, like 10**400, is None rather than an OverflowError)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        return None


def _show(value: object) -> str:
    """A short repr for error messages (a request may send a megabyte of junk)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not replace the ValueError
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else f"{text[:57]}..."


def greedy(logits: mx.array) -> mx.array:
    """``(B, V)`` logits -> ``(B,)`` int32 argmax."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def sample_top_p(logits: mx.array, temperature: mx.array, top_p: mx.array, u: mx.array) -> mx.array:
    """Nucleus sampling on device.

    ``logits`` (B, V); ``temperature``, ``top_p``, ``u`` (B,) float32 with temperature > 0,
    top_p in (0, 1] and ``u`` uniform in [0, 1). Returns (B,) int32 token ids: the first sorted
    token whose cumulative probability exceeds ``u`` times the nucleus mass. Numerically safe for
    any temperature >= ``MIN_TEMPERATURE``: each row's largest logit is subtracted before the
    division (no ``inf / inf``), and the nucleus always keeps the most probable token (a ``top_p``
    that rounds to 0 in float32 keeps that token only).
    """
    z = logits.astype(mx.float32)
    probs = mx.softmax((z - z.max(axis=-1, keepdims=True)) / temperature[:, None], axis=-1)
    order = mx.argsort(-probs, axis=-1)
    sorted_p = mx.take_along_axis(probs, order, axis=-1)
    cum = mx.cumsum(sorted_p, axis=-1)
    keep = (cum - sorted_p) < top_p[:, None]  # mass before the token is below top_p
    n_keep = mx.maximum(keep.sum(axis=-1), 1)
    mass = mx.take_along_axis(cum, (n_keep - 1)[:, None], axis=-1)[:, 0]
    k = ((cum < (u * mass)[:, None]) & keep).sum(axis=-1)
    k = mx.minimum(k, n_keep - 1)
    return mx.take_along_axis(order, k[:, None], axis=-1)[:, 0].astype(mx.int32)
