"""Verification of a draft against the target at its span's positions.

A row's verify span feeds ``[last, d_1 .. d_k]``; the runner samples a token ``s_i`` at every
position ``i = 0..k`` with the row's own sampler chain (its processors and filters applied to the
target's logits there, its own uniform draws in order). Draft token ``d_{i+1}`` is accepted while
it equals ``s_i``; the row emits ``d_1 .. d_a`` and then ``s_a`` (:func:`accepted`).

For a draft that is a point mass (an n-gram draft, or any greedy row) this is exactly the
rejection sampler of Leviathan et al. 2023 / Chen et al. 2023: ``d`` is accepted with probability
``min(1, p(d) / q(d)) = p(d)``, and on rejection the emitted token is distributed as
``norm(max(0, p - q))`` = p without ``d``; the emitted tokens are the ones plain decoding would
sample with the same uniforms, so greedy output is token-identical and a seeded sampled one is too.

A sampled row whose draft was drawn from a draft model's distribution q (``(k, V)``, the row's
chain applied to the draft's logits, :func:`chain_probs`) is verified by the general rule instead
(:func:`rejection_tokens`): ``d_i`` is accepted when ``u * q(d_i) <= p(d_i)`` (``u`` uniform in
(0, 1]), else the position's token is drawn from ``norm(max(0, p - q))``, and after k accepted
drafts the bonus token from p. The result is written as the span's samples ``s_0 .. s_k``
(``s_i = d_{i+1}`` where accepted; a resampled token is never ``d_{i+1}``, whose residual mass is
0 there), so :func:`accepted` reads it as before. Such a row draws ``2k + 1`` uniforms per verify
and is not rewound to one per emitted token: seeded output is reproducible, not equal to plain
decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..logits import RowInput, process
from ..sampling import MIN_TEMPERATURE, min_p_limit, sort_probs, top_p_limit

__all__ = ["DraftedSpan", "accepted", "chain_probs", "rejection_tokens", "resample_drafted"]


def accepted(draft: np.ndarray, sampled: np.ndarray) -> int:
    """How many leading draft tokens (``draft`` ``(k,)``) the samples ``sampled`` ``(k + 1,)``
    reproduce: the largest ``a`` with ``draft[:a] == sampled[:a]``; the row emits
    ``sampled[: a + 1]``."""
    miss = np.flatnonzero(np.asarray(draft) != np.asarray(sampled)[: len(draft)])
    return int(miss[0]) if miss.size else len(draft)


def chain_probs(x: mx.array, rows: Sequence[RowInput]) -> mx.array:
    """The distribution each sampled row's chain draws from, ``(b, V)`` float32 rows summing to 1,
    for ``x`` ``(b, V)`` logits with the rows' processors applied: softmax at the row's
    temperature, then top-k, top-p (over the top-k mass) and min-p, renormalized; the same
    distribution as the chain's sampler (:mod:`..logits`). Every row must be sampled (temperature
    >= ``MIN_TEMPERATURE``)."""
    params = [r.chain.params for r in rows]
    if any(p.temperature < MIN_TEMPERATURE for p in params):
        raise ValueError("chain_probs needs sampled rows (temperature >= MIN_TEMPERATURE)")
    vocab = x.shape[-1]
    d = sort_probs(x, mx.array([p.temperature for p in params], dtype=mx.float32))
    n = mx.array([min(p.top_k, vocab) if p.top_k else vocab for p in params], dtype=mx.int32)
    n = top_p_limit(d, mx.array([p.top_p for p in params], dtype=mx.float32), n)
    n = mx.maximum(min_p_limit(d, mx.array([p.min_p for p in params], dtype=mx.float32), n), 1)
    kept = mx.where(mx.arange(vocab)[None, :] < n[:, None], d.probs, 0.0)
    kept = kept / kept.sum(axis=-1, keepdims=True)
    return mx.put_along_axis(mx.zeros_like(kept), d.order, kept, axis=-1)


def rejection_tokens(p: mx.array, q: mx.array, draft: np.ndarray, rng: np.random.Generator) -> mx.array:
    """The span's samples ``(k + 1,)`` int32 under the general rejection rule (module docstring)
    for target distributions ``p`` ``(k + 1, V)``, draft distributions ``q`` ``(k, V)`` and the
    draft ``(k,)`` drawn from q; ``2k + 1`` uniforms from ``rng``."""
    k = len(draft)
    d = mx.array(np.asarray(draft, dtype=np.int32))
    u_accept = mx.array(1.0 - rng.random(k), dtype=mx.float32)  # (0, 1]: p(d) = 0 never accepts
    u_draw = mx.array(rng.random(k + 1), dtype=mx.float32)
    p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
    residual = mx.concatenate([mx.maximum(p[:k] - q, 0.0), p[k:]], axis=0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)  # p == q: never drawn
    cum = mx.cumsum(residual, axis=-1)
    drawn = (cum <= (u_draw * cum[:, -1])[:, None]).sum(axis=-1)
    last = mx.max(mx.where(residual > 0, mx.arange(residual.shape[-1]), 0), axis=-1)
    drawn = mx.minimum(drawn, last).astype(mx.int32)
    keep = mx.concatenate([u_accept * q_d <= p_d, mx.array([False])])
    return mx.where(keep, mx.concatenate([d, mx.array([0], dtype=mx.int32)]), drawn)


@dataclass(frozen=True)
class DraftedSpan:
    """One verify span whose draft a draft model sampled: its first index ``at`` in the batch's
    positions, its ``draft`` ``(k,)``, the draft's distributions ``q`` ``(k, V)``, its request's
    sampler ``rows`` (k + 1, one per position) and generator ``rng``."""

    at: int
    draft: np.ndarray
    q: mx.array
    rows: Sequence[RowInput]
    rng: np.random.Generator


def resample_drafted(logits: mx.array, samples: mx.array, spans: Sequence[DraftedSpan]) -> mx.array:
    """``samples`` ``(M,)`` (a batch of verify spans' per-position samples over ``logits``
    ``(M, V)``, span after span) with each of the drafted ``spans`` (in order) replaced by
    :func:`rejection_tokens` of the target's distributions there."""
    parts, prev = [], 0
    for span in spans:
        n = len(span.rows)
        p = chain_probs(process(logits[span.at : span.at + n], span.rows), span.rows)
        parts += [samples[prev : span.at], rejection_tokens(p, span.q, span.draft, span.rng)]
        prev = span.at + n
    if not parts:
        return samples
    return mx.concatenate([*parts, samples[prev:]]).astype(mx.int32)
