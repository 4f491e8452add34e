"""The per-request sampler chain and its application to a whole batch on the device.

A request's chain (:func:`make_chain`, built once at ``Engine.add``) lists the stages its
:class:`~.sampling.SamplingParams` turn on, as functions, in the order of vLLM v1's sampler
(``vllm/v1/sample/sampler.py``):

1. logits processors, on float32 logits: ``logit_bias`` (added), the ``min_tokens`` EOS mask
   (``-inf`` while fewer than ``min_tokens`` tokens were generated), the repetition penalty (HF
   ``RepetitionPenaltyLogitsProcessor`` / mlx-lm: a token seen in the prompt or the output has a
   positive logit divided by the penalty, a negative one multiplied), the presence and frequency
   penalties (OpenAI: ``logit - presence * [count > 0] - frequency * count`` over the counts of the
   generated tokens), then the constraint mask (``-inf`` outside ``TokenConstraint.allowed()``);
2. log-probabilities of these processed logits (``log_softmax``), when the request asks;
3. greedy rows: argmax of the processed logits. Sampled rows: temperature, top-k (the ``k`` most
   probable tokens), top-p (the nucleus of Holtzman et al. 2020 over the probabilities
   renormalized after top-k), min-p (tokens with probability >= ``min_p`` times the most
   probable one; Nguyen et al. 2024, "Min P Sampling"), then inverse-CDF sampling with one
   uniform draw of the request's own generator over the kept tokens in decreasing probability.

:func:`sample_batch` runs, for a batch of rows with different parameters, the union of the rows'
stages; a row that does not use a stage gets its neutral value (bias 0, penalty 1 / 0,
temperature 1, top-k = vocabulary, top-p 1, min-p 0), which leaves its values bit-identical, so a
row's tokens do not depend on its batchmates. A stage no row uses adds no graph node: an
all-greedy batch without options is one argmax, as before.

Penalty state lives on the device (:class:`TokenHistory`: per-row counts of generated tokens and a
prompt-token mask, rows x vocabulary), updated from the sampled tokens inside the step's graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .sampling import (MIN_TEMPERATURE, SamplingParams, SortedProbs, draw_sorted, min_p_limit, sort_probs,
                       top_k_limit, top_p_limit)

__all__ = ["Chain", "Logprobs", "RowInput", "TokenHistory", "make_chain", "process", "sample", "sample_batch"]

_NEG_INF = float("-inf")


class TokenHistory:
    """Device-side penalty state for ``rows`` engine rows over ``vocab`` tokens: ``counts``
    ``(rows, vocab)`` float32 (how often each token was generated) and ``prompt`` ``(rows,
    vocab)`` bool (the token occurs in the prompt)."""

    def __init__(self, rows: int, vocab: int):
        self.vocab = vocab
        self.counts = mx.zeros((rows, vocab), dtype=mx.float32)
        self.prompt = mx.zeros((rows, vocab), dtype=mx.bool_)

    def reset(self, row: int, prompt: np.ndarray, generated: Sequence[int]) -> None:
        """Start ``row`` over for a sequence with this prompt and these generated tokens (a
        sequence recomputed after a preemption gets its counts back)."""
        self.prompt[row] = mx.array(np.bincount(prompt, minlength=self.vocab)[: self.vocab] > 0)
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=self.vocab)[: self.vocab]
        self.counts[row] = mx.array(counts.astype(np.float32))

    def record(self, rows: mx.array, tokens: mx.array) -> None:
        """Count ``tokens`` ``(b,)`` for engine ``rows`` ``(b,)`` (lazily, in the step's graph)."""
        self.counts = self.counts.at[rows, tokens].add(1.0)

    def arrays(self) -> list[mx.array]:
        return [self.counts, self.prompt]


@dataclass(frozen=True)
class RowInput:
    """One batch row at sampling time: its sequence's chain, its engine row (the
    :class:`TokenHistory` row), the tokens generated before this one, its constraint's mask
    ``(vocab,)`` bool (None: unconstrained) and its generator (sampled rows draw one uniform)."""

    chain: "Chain"
    row: int = 0
    generated: int = 0
    allowed: np.ndarray | None = None
    rng: np.random.Generator | None = None


Stage = Callable[[mx.array, Sequence[RowInput], "TokenHistory | None"], mx.array]
Filter = Callable[[SortedProbs, Sequence[RowInput], "mx.array | None"], mx.array]


@dataclass(frozen=True, eq=False)
class Chain:
    """A request's sampler chain: its logits processors and (for sampled rows) its filters, in
    order; ``bias_ids`` / ``bias_values`` its logit_bias, ``eos_ids`` the EOS ids masked until
    ``params.min_tokens``. Built by :func:`make_chain`."""

    params: SamplingParams
    processors: tuple[Stage, ...]
    filters: tuple[Filter, ...]
    greedy: bool
    bias_ids: np.ndarray
    bias_values: np.ndarray
    eos_ids: np.ndarray

    @property
    def penalized(self) -> bool:
        """True when the chain reads the :class:`TokenHistory`."""
        return _penalties in self.processors


def make_chain(params: SamplingParams, vocab_size: int) -> Chain:
    """The chain of ``params`` for a model of ``vocab_size`` tokens. Raises ValueError naming
    ``logit_bias`` for a biased token id outside the vocabulary."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {bad[:5]}")
    eos = np.array([e for e in params.eos_token_ids if e < vocab_size], dtype=np.int32)
    processors: list[Stage] = []
    if params.logit_bias:
        processors.append(_logit_bias)
    if params.min_tokens > 0 and eos.size:
        processors.append(_min_tokens)
    if params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty:
        processors.append(_penalties)
    if params.grammar is not None:
        processors.append(_constraint_mask)
    greedy = params.temperature < MIN_TEMPERATURE
    filters: list[Filter] = []
    if not greedy:
        if params.top_k:
            filters.append(_top_k)
        if params.top_p < 1:
            filters.append(_top_p)
        if params.min_p > 0:
            filters.append(_min_p)
    return Chain(params, tuple(processors), tuple(filters), greedy,
                 np.array([t for t, _ in params.logit_bias], dtype=np.int32),
                 np.array([b for _, b in params.logit_bias], dtype=np.float32), eos)


# ---- logits processors: (B, V) float32 logits -> (B, V) ------------------------------------


def _scatter_add(x: mx.array, rows: list[int], cols: list[np.ndarray], values: list[np.ndarray]) -> mx.array:
    if not rows:
        return x
    r = np.concatenate([np.full(len(c), i, dtype=np.int32) for i, c in zip(rows, cols)])
    return x.at[mx.array(r), mx.array(np.concatenate(cols))].add(mx.array(np.concatenate(values)))


def _logit_bias(x: mx.array, rows: Sequence[RowInput], history: TokenHistory | None) -> mx.array:
    use = [i for i, r in enumerate(rows) if r.chain.bias_ids.size]
    return _scatter_add(x, use, [rows[i].chain.bias_ids for i in use], [rows[i].chain.bias_values for i in use])


def _min_tokens(x: mx.array, rows: Sequence[RowInput], history: TokenHistory | None) -> mx.array:
    use = [i for i, r in enumerate(rows) if r.generated < r.chain.params.min_tokens and r.chain.eos_ids.size]
    cols = [rows[i].chain.eos_ids for i in use]
    return _scatter_add(x, use, cols, [np.full(len(c), _NEG_INF, dtype=np.float32) for c in cols])


def _penalties(x: mx.array, rows: Sequence[RowInput], history: TokenHistory | None) -> mx.array:
    use = [i for i, r in enumerate(rows) if r.chain.penalized]
    params = [rows[i].chain.params for i in use]
    engine_rows = mx.array([rows[i].row for i in use], dtype=mx.int32)
    idx = mx.array(use, dtype=mx.int32)
    sub, counts = x[idx], history.counts[engine_rows]
    if any(p.repetition_penalty != 1 for p in params):
        rep = mx.array([p.repetition_penalty for p in params], dtype=mx.float32)[:, None]
        seen = history.prompt[engine_rows] | (counts > 0)
        sub = mx.where(seen, mx.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        presence = mx.array([p.presence_penalty for p in params], dtype=mx.float32)[:, None]
        frequency = mx.array([p.frequency_penalty for p in params], dtype=mx.float32)[:, None]
        sub = sub - presence * (counts > 0) - frequency * counts
    x[idx] = sub
    return x


def _constraint_mask(x: mx.array, rows: Sequence[RowInput], history: TokenHistory | None) -> mx.array:
    use = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not use:
        return x
    idx = mx.array(use, dtype=mx.int32)
    mask = mx.array(np.stack([rows[i].allowed for i in use]))
    x[idx] = mx.where(mask, x[idx], _NEG_INF)
    return x


_PROCESSORS: tuple[Stage, ...] = (_logit_bias, _min_tokens, _penalties, _constraint_mask)


def process(logits: mx.array, rows: Sequence[RowInput], history: TokenHistory | None = None) -> mx.array:
    """Apply the union of the rows' logits processors to ``logits`` ``(B, V)`` (float32 out when
    any runs; the input unchanged when none does). ``history`` is needed when a row is penalized."""
    stages = [p for p in _PROCESSORS if any(p in r.chain.processors for r in rows)]
    if not stages:
        return logits
    x = logits.astype(mx.float32)
    for stage in stages:
        x = stage(x, rows, history)
    return x


# ---- sampling filters over the sorted distribution -----------------------------------------


def _param(rows: Sequence[RowInput], name: str) -> mx.array:
    return mx.array([getattr(r.chain.params, name) for r in rows], dtype=mx.float32)


def _top_k(d: SortedProbs, rows: Sequence[RowInput], n: mx.array | None) -> mx.array:
    return top_k_limit(d, mx.array([r.chain.params.top_k or d.vocab for r in rows], dtype=mx.int32), n)


def _top_p(d: SortedProbs, rows: Sequence[RowInput], n: mx.array | None) -> mx.array:
    return top_p_limit(d, _param(rows, "top_p"), n)


def _min_p(d: SortedProbs, rows: Sequence[RowInput], n: mx.array | None) -> mx.array:
    return min_p_limit(d, _param(rows, "min_p"), n)


_FILTERS: tuple[Filter, ...] = (_top_k, _top_p, _min_p)


def _sample_rows(x: mx.array, rows: Sequence[RowInput], u: np.ndarray) -> mx.array:
    """Sampled rows: ``x`` (b, V) processed logits -> (b,) int32 tokens, ``u`` (b,) uniforms."""
    d = sort_probs(x, _param(rows, "temperature"))
    n: mx.array | None = None
    for f in _FILTERS:
        if any(f in r.chain.filters for r in rows):
            n = f(d, rows, n)
    return draw_sorted(d, n, mx.array(u, dtype=mx.float32))


def sample(x: mx.array, rows: Sequence[RowInput], u: np.ndarray | None = None) -> mx.array:
    """``x`` (B, V) processed logits -> (B,) int32 tokens: argmax for greedy rows, the chain's
    filters and one uniform for sampled rows (``u``: one per sampled row, in row order; None:
    drawn from each sampled row's ``rng``)."""
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    sampled = [i for i, r in enumerate(rows) if not r.chain.greedy]
    if sampled:
        if u is None:
            u = np.array([rows[i].rng.random() for i in sampled])
        idx = mx.array(sampled, dtype=mx.int32)
        tokens[idx] = _sample_rows(x[idx], [rows[i] for i in sampled], u)
    return tokens


# ---- logprobs ------------------------------------------------------------------------------


@dataclass
class Logprobs:
    """Log-probabilities of the batch rows at ``positions`` (the rows whose params ask):
    ``chosen`` (b,) of the sampled token, ``top_ids`` / ``top_values`` (b, N) the N most probable
    (descending; N the largest request), ``counts`` each row's own N."""

    positions: list[int]
    counts: list[int]
    chosen: mx.array
    top_ids: mx.array | None = None
    top_values: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def to_host(self) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
        """Per asking row: (chosen logprob, top-N (token id, logprob) pairs)."""
        chosen = np.array(self.chosen).tolist()
        ids = np.array(self.top_ids).tolist() if self.top_ids is not None else None
        vals = np.array(self.top_values).tolist() if self.top_values is not None else None
        out = []
        for j, n in enumerate(self.counts):
            top = tuple(zip(ids[j][:n], vals[j][:n])) if n else ()
            out.append((chosen[j], top))
        return out


def _logprobs(x: mx.array, rows: Sequence[RowInput], tokens: mx.array) -> Logprobs | None:
    use = [i for i, r in enumerate(rows) if r.chain.params.logprobs is not None]
    if not use:
        return None
    idx = mx.array(use, dtype=mx.int32)
    sub = x[idx].astype(mx.float32)
    lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
    counts = [rows[i].chain.params.logprobs for i in use]
    out = Logprobs(use, counts, mx.take_along_axis(lp, tokens[idx][:, None], axis=-1)[:, 0])
    n = max(counts)
    if n:
        part = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n].astype(mx.int32)
        vals = mx.take_along_axis(lp, part, axis=-1)
        o = mx.argsort(-vals, axis=-1)
        out.top_ids = mx.take_along_axis(part, o, axis=-1)
        out.top_values = mx.take_along_axis(vals, o, axis=-1)
    return out


# ---- the whole step --------------------------------------------------------------------------


@dataclass
class BatchOutput:
    """What :func:`sample_batch` enqueued: ``tokens`` (B,) int32 and the asking rows' logprobs."""

    tokens: mx.array
    logprobs: Logprobs | None = None
    pending: list[mx.array] = field(default_factory=list)  # arrays to evaluate with the step


def sample_batch(logits: mx.array, rows: Sequence[RowInput], history: TokenHistory | None = None) -> BatchOutput:
    """One step's sampling for ``logits`` (B, V), row i belonging to ``rows[i]``: processors,
    logprobs, greedy / sampled tokens, and the penalized rows' counts recorded in ``history``.
    Lazy: nothing is evaluated."""
    x = process(logits, rows, history)
    tokens = sample(x, rows)
    out = BatchOutput(tokens, _logprobs(x, rows, tokens))
    penalized = [i for i, r in enumerate(rows) if r.chain.penalized]
    if penalized:
        history.record(mx.array([rows[i].row for i in penalized], dtype=mx.int32),
                       tokens[mx.array(penalized, dtype=mx.int32)])
    if out.logprobs is not None:
        out.pending += out.logprobs.arrays()
    return out
