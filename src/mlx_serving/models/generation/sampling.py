"""Per-request sampling parameters and the device primitives of sampling.

:class:`SamplingParams` holds every option (the table in docs/generation.md, "Sampling"); the
sampler chain that applies them to a batch is :mod:`.logits`. Semantics as in mlx-lm, vLLM and
the OpenAI API: ``temperature == 0`` is greedy decoding (argmax); ``temperature > 0`` samples from
the softmax at that temperature, restricted by top-k, the nucleus of ``top_p`` (Holtzman et al.
2020, "The Curious Case of Neural Text Degeneration": keep the smallest set of tokens, in order of
decreasing probability, whose total probability reaches ``top_p``, the token that crosses it
included, renormalize) and min-p. The primitives here work on a sorted distribution
(:func:`sort_probs`, :func:`top_p_limit`, :func:`min_p_limit`, :func:`draw_sorted`) or an
unsorted one (:func:`draw_unsorted`); :func:`sample_top_p` is nucleus sampling built from them.

Numerics: a temperature below :data:`MIN_TEMPERATURE` (1e-5) is greedy decoding, like 0. At such a
temperature the softmax is already one-hot in float32 except between logits closer than ~1e-3, and
dividing raw logits by it would overflow (1e-38 gave ``inf / inf`` = NaN probabilities and the last
token id of the vocabulary) or divide by zero (a float64 below ~1.4e-45 is 0 in float32). Above it,
:func:`tempered_probs` (used by every sampled path, sorted or not) subtracts each row's largest logit
before dividing, so every scaled logit is <= 0 and the softmax never sees ``inf``.

Randomness: each request owns a ``numpy.random.Generator`` seeded from its ``seed``; each sampled
token consumes exactly one uniform draw from it, so a request's tokens do not depend on its
batchmates.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import mlx.core as mx

__all__ = ["MAX_LOGPROBS", "MAX_SEED", "MIN_TEMPERATURE", "SamplerKind", "SamplingParams", "SortedProbs", "draw_sorted",
           "draw_unsorted", "greedy", "min_p_limit", "sample_top_p", "sort_probs", "tempered_probs",
           "top_p_limit"]

#: Temperatures below this are greedy decoding (see the module docstring).
MIN_TEMPERATURE = 1e-5
#: Seeds are ints in [0, MAX_SEED): what a 64-bit seed holds.
MAX_SEED = 2**64
#: At most this many top alternatives per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


class SamplerKind(enum.Enum):
    """How a sequence's next token is chosen (:attr:`SamplingParams.kind`)."""

    GREEDY = "greedy"  # argmax (temperature 0, or below MIN_TEMPERATURE)
    TOP_P = "top_p"  # nucleus sampling at a temperature >= MIN_TEMPERATURE (top_p 1: plain temperature sampling)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options (the table in docs/generation.md, "Sampling").

    ``max_new_tokens``: an int >= 1 (an EOS counts). ``temperature``: a finite real number >= 0,
    0 (or anything below ``MIN_TEMPERATURE``, 1e-5) = greedy. ``top_p``: a real number in (0, 1],
    used when sampling. ``seed``: an int in [0, 2**64) for reproducible sampling (None: fresh
    entropy). ``eos_token_ids``: generation stops after any of them.

    Off by default: ``top_k`` (int >= 0; keep the k most probable tokens, 0 = off), ``min_p``
    (in [0, 1]; drop tokens below ``min_p`` times the top probability, 0 = off),
    ``repetition_penalty`` (> 0, finite; HF / mlx-lm: a positive logit of a token seen in the
    prompt or the output is divided by it, a negative one multiplied; 1 = off),
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]; OpenAI: subtract
    ``presence * [count > 0] + frequency * count`` over the generated tokens' counts),
    ``logit_bias`` (token id -> bias in [-100, 100], added to the logit; a mapping is accepted and
    stored as a tuple of (id, bias) sorted by id; ids are checked against the vocabulary by
    ``Engine.add``), ``min_tokens`` (0 <= min_tokens <= max_new_tokens: the EOS ids are masked
    until that many tokens were generated), ``logprobs`` (None = off; an int in [0, 20]: return
    the sampled token's log-probability and that many top alternatives), ``grammar`` (None, or a
    compiled constraint spec passed to the engine's ``constraint_factory``).

    ``bool`` is not a number here (``True`` is refused everywhere). Numbers are stored as int /
    float. Raises ValueError on construction, naming the option, for any value of the wrong type
    or out of range. Picklable (it crosses process boundaries).
    """

    max_new_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {_show(self.max_new_tokens)}")
        set_(self, "max_new_tokens", int(self.max_new_tokens))
        set_(self, "temperature", _real("temperature", self.temperature, 0.0, math.inf, ">= 0"))
        top_p = _as_float(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {_show(self.top_p)}")
        set_(self, "top_p", top_p)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {_show(self.seed)}")
        set_(self, "seed", None if self.seed is None else int(self.seed))
        set_(self, "eos_token_ids", _token_ids("eos_token_ids", self.eos_token_ids))
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {_show(self.top_k)}")
        set_(self, "top_k", int(self.top_k))
        set_(self, "min_p", _real("min_p", self.min_p, 0.0, 1.0, "in [0, 1]"))
        rep = _as_float(self.repetition_penalty)
        if rep is None or not math.isfinite(rep) or rep <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {_show(self.repetition_penalty)}")
        set_(self, "repetition_penalty", rep)
        set_(self, "presence_penalty", _real("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]"))
        set_(self, "frequency_penalty", _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]"))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {_show(self.min_tokens)}")
        set_(self, "min_tokens", int(self.min_tokens))
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        set_(self, "logprobs", None if self.logprobs is None else int(self.logprobs))
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be None or a string, got {type(self.grammar).__name__}")

    @property
    def kind(self) -> SamplerKind:
        """GREEDY when ``temperature < MIN_TEMPERATURE`` (0 included), else TOP_P."""
        return SamplerKind.GREEDY if self.temperature < MIN_TEMPERATURE else SamplerKind.TOP_P


def _real(name: str, value: object, lo: float, hi: float, what: str) -> float:
    """``value`` as a finite float in [lo, hi] (hi may be inf), else ValueError naming ``name``."""
    x = _as_float(value)
    if x is None or not math.isfinite(x) or not lo <= x <= hi:
        raise ValueError(f"{name} must be a finite number {what}, got {_show(value)}")
    return x


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a sequence of integer token ids, got {_show(value)}")
    items = tuple(value)
    ids = [int(t) for t in items if isinstance(t, numbers.Integral) and not isinstance(t, bool) and int(t) >= 0]
    if len(ids) != len(items):
        raise ValueError(f"{name} must hold integer token ids >= 0, got {_show(value)}")
    return tuple(ids)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or (id, bias) pairs -> pairs sorted by id; ValueError naming logit_bias."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        try:
            pairs = [tuple(p) for p in value]  # type: ignore[attr-defined]  # any iterable of pairs; TypeError below
        except TypeError:
            raise ValueError(f"logit_bias must be a mapping of token id -> bias, got {_show(value)}") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0:
            raise ValueError(f"logit_bias keys must be integer token ids >= 0, got {_show(pair)}")
        bias = _as_float(pair[1])
        if bias is None or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {_show(pair[1])} "
                             f"for token {pair[0]}")
        if int(pair[0]) in out:
            raise ValueError(f"logit_bias has token {pair[0]} twice")
        out[int(pair[0])] = bias
    return tuple(sorted(out.items()))


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


@dataclass(frozen=True)
class SortedProbs:
    """A batch's tempered distribution sorted by decreasing probability: ``order`` (b, V) token
    ids, ``probs`` (b, V) float32 their probabilities, ``cum`` (b, V) the running sums."""

    order: mx.array
    probs: mx.array
    cum: mx.array

    @property
    def vocab(self) -> int:
        """V, the number of sorted tokens per row."""
        return self.probs.shape[-1]


def tempered_probs(logits: mx.array, temperature: mx.array) -> mx.array:
    """``softmax(logits / temperature)`` (b, V) float32 for ``logits`` (b, V) and ``temperature``
    (b,) float32 >= ``MIN_TEMPERATURE``. Each row's largest logit is subtracted before the division
    (no ``inf / inf``)."""
    z = logits.astype(mx.float32)
    return mx.softmax((z - z.max(axis=-1, keepdims=True)) / temperature[:, None], axis=-1)


def sort_probs(logits: mx.array, temperature: mx.array) -> SortedProbs:
    """``logits`` (b, V) at ``temperature`` (b,) float32 >= ``MIN_TEMPERATURE`` -> the sorted
    softmax (:func:`tempered_probs`)."""
    probs = tempered_probs(logits, temperature)
    order = mx.argsort(-probs, axis=-1)
    sorted_p = mx.take_along_axis(probs, order, axis=-1)
    return SortedProbs(order, sorted_p, mx.cumsum(sorted_p, axis=-1))


def top_p_limit(d: SortedProbs, top_p: mx.array, n: mx.array | None) -> mx.array:
    """Top-p (nucleus): of the ``n`` (b,) int32 kept so far (None: all), the tokens whose
    preceding mass, renormalized over those ``n``, is below ``top_p`` (b,) float32 (the token
    crossing it included; 1: all). Returns the new count of kept tokens (a prefix of the sorted
    order)."""
    if n is None:
        threshold, n = top_p, mx.full(top_p.shape, d.vocab, dtype=mx.int32)
    else:
        mass = mx.take_along_axis(d.cum, (n - 1)[:, None], axis=-1)[:, 0]
        threshold = top_p * mx.where(n < d.vocab, mass, 1.0)
    count = ((d.cum - d.probs) < threshold[:, None]).sum(axis=-1).astype(mx.int32)
    return mx.where(top_p >= 1, n, mx.minimum(n, count))


def min_p_limit(d: SortedProbs, min_p: mx.array, n: mx.array | None) -> mx.array:
    """Min-p: the tokens whose probability is at least ``min_p`` (b,) float32 times the most
    probable one's (0: all), within the ``n`` kept so far."""
    count = (d.probs >= (min_p * d.probs[:, 0])[:, None]).sum(axis=-1).astype(mx.int32)
    return count if n is None else mx.minimum(n, count)


def draw_sorted(d: SortedProbs, n: mx.array | None, u: mx.array) -> mx.array:
    """Inverse-CDF draw among the first ``n`` (b,) sorted tokens (None: all; at least one is kept),
    renormalized, with ``u`` (b,) uniforms in [0, 1): the first kept token whose running mass
    exceeds ``u`` times the kept mass. Returns (b,) int32 token ids."""
    n_keep = mx.full(u.shape, d.vocab, dtype=mx.int32) if n is None else mx.maximum(n, 1)
    mass = mx.take_along_axis(d.cum, (n_keep - 1)[:, None], axis=-1)[:, 0]
    k = (d.cum < (u * mass)[:, None]).sum(axis=-1)
    k = mx.minimum(k, n_keep - 1)
    return mx.take_along_axis(d.order, k[:, None], axis=-1)[:, 0].astype(mx.int32)


def draw_unsorted(probs: mx.array, u: mx.array) -> mx.array:
    """Inverse-CDF draw in token-id order from ``probs`` (b, V) float32 (zeros: excluded; rows
    need not sum to 1) with ``u`` (b,) uniforms in [0, 1): the first token whose running mass
    exceeds ``u`` times the row's mass, never one of probability 0. Returns (b,) int32 ids."""
    cum = mx.cumsum(probs, axis=-1)
    k = (cum <= (u * cum[:, -1])[:, None]).sum(axis=-1)
    last = mx.max(mx.where(probs > 0, mx.arange(probs.shape[-1]), 0), axis=-1)
    return mx.minimum(k, last).astype(mx.int32)


def sample_top_p(logits: mx.array, temperature: mx.array, top_p: mx.array, u: mx.array) -> mx.array:
    """Nucleus sampling on device.

    ``logits`` (B, V); ``temperature``, ``top_p``, ``u`` (B,) float32 with temperature > 0,
    top_p in (0, 1] and ``u`` uniform in [0, 1). Returns (B,) int32 token ids: the first sorted
    token whose cumulative probability exceeds ``u`` times the nucleus mass. Numerically safe for
    any temperature >= ``MIN_TEMPERATURE`` (see :func:`sort_probs`), and the nucleus always keeps
    the most probable token (a ``top_p`` that rounds to 0 in float32 keeps that token only).
    """
    d = sort_probs(logits, temperature)
    return draw_sorted(d, top_p_limit(d, top_p, None), u)
