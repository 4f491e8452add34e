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
processors; a row that does not use one gets its neutral value (bias 0, repetition penalty 1,
presence / frequency 0), which leaves its logits bit-identical. Sampled rows are drawn by their
chain's sampler, rows sharing one sampler in one call: top-k rows (grouped by k) take the ``k``
largest logits with an O(V) ``argpartition`` and sort only those; top-p rows without top-k sort
the whole vocabulary (the costly case: ~25 ms per 151,936-token row on the CPU, see
docs/benchmarks.md); rows with neither (temperature, min-p) need no sort and draw in token-id
order, which has the same distribution. Within a call, top-p and min-p are neutral (1, 0) for
rows without them. So a row's tokens do not depend on its batchmates, and a stage no row uses adds
no graph node: an all-greedy batch without options is one argmax, as before.

Penalty state lives on the device (:class:`TokenHistory`: per-row counts of generated tokens and a
prompt-token mask, rows x vocabulary), updated from the sampled tokens inside the step's graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .sampling import (MIN_TEMPERATURE, SamplingParams, SortedProbs, draw_sorted, draw_unsorted, min_p_limit,
                       sort_probs, tempered_probs, top_p_limit)

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
        """``[counts, prompt]``: the state to evaluate with the step that updated it."""
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
Sampler = Callable[[mx.array, Sequence[RowInput], mx.array], mx.array]


@dataclass(frozen=True, eq=False)
class Chain:
    """A request's sampler chain: its logits processors in order, its sampler (None: greedy) and
    the filters the sampler applies (top-p, min-p), in order; ``bias_ids`` / ``bias_values`` its
    logit_bias, ``eos_ids`` the EOS ids masked until ``params.min_tokens``; ``argmax_only``: greedy,
    no processor and no logprobs (:func:`sample_batch` would only take the argmax). Built by
    :func:`make_chain`."""

    params: SamplingParams
    processors: tuple[Stage, ...]
    sampler: Sampler | None  # None: greedy
    filters: tuple[Filter, ...]
    bias_ids: np.ndarray
    bias_values: np.ndarray
    eos_ids: np.ndarray
    argmax_only: bool

    @property
    def greedy(self) -> bool:
        """True when the chain takes the argmax of its processed logits (temperature < 1e-5)."""
        return self.sampler is None

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
    sampler: Sampler | None = None
    filters = ((_top_p,) if params.top_p < 1 else ()) + ((_min_p,) if params.min_p > 0 else ())
    if params.temperature >= MIN_TEMPERATURE:
        sampler = _sample_top_k if params.top_k else _sample_nucleus if params.top_p < 1 else _sample_plain
    return Chain(params, tuple(processors), sampler, filters,
                 np.array([t for t, _ in params.logit_bias], dtype=np.int32),
                 np.array([b for _, b in params.logit_bias], dtype=np.float32), eos,
                 argmax_only=sampler is None and not processors and params.logprobs is None)


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


def _needed(history: TokenHistory | None) -> TokenHistory:
    """The penalty state a penalized row needs (the runner makes it for the first such request)."""
    if history is None:
        raise RuntimeError("a penalized row was sampled without a TokenHistory")
    return history


def _rng(row: RowInput) -> np.random.Generator:
    """A sampled row's generator (every request has one: ``Engine.add`` seeds it)."""
    if row.rng is None:
        raise RuntimeError("a sampled row has no random generator")
    return row.rng


def _penalties(x: mx.array, rows: Sequence[RowInput], history: TokenHistory | None) -> mx.array:
    history = _needed(history)
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
    mask = mx.array(np.stack([a for i in use if (a := rows[i].allowed) is not None]))
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


# ---- samplers: (b, V) processed logits of rows sharing one sampler -> (b,) int32 tokens --------


def _param(rows: Sequence[RowInput], name: str) -> mx.array:
    return mx.array([getattr(r.chain.params, name) for r in rows], dtype=mx.float32)


def _top_p(d: SortedProbs, rows: Sequence[RowInput], n: mx.array | None) -> mx.array:
    return top_p_limit(d, _param(rows, "top_p"), n)


def _min_p(d: SortedProbs, rows: Sequence[RowInput], n: mx.array | None) -> mx.array:
    return min_p_limit(d, _param(rows, "min_p"), n)


_FILTERS: tuple[Filter, ...] = (_top_p, _min_p)


def _draw_filtered(d: SortedProbs, rows: Sequence[RowInput], u: mx.array) -> mx.array:
    """The rows' filters (those any row uses; the others' values are neutral), then the draw."""
    n: mx.array | None = None
    for f in _FILTERS:
        if any(f in r.chain.filters for r in rows):
            n = f(d, rows, n)
    return draw_sorted(d, n, u)


def _sample_top_k(z: mx.array, rows: Sequence[RowInput], u: mx.array) -> mx.array:
    """Rows sharing one ``top_k`` = k: the k largest logits (``argpartition``, O(V)), then
    temperature, top-p and min-p over their renormalized distribution, sorted (k entries)."""
    k = rows[0].chain.params.top_k
    if k >= z.shape[-1]:
        return _draw_filtered(sort_probs(z, _param(rows, "temperature")), rows, u)
    candidates = mx.argpartition(-z, kth=k - 1, axis=-1)[:, :k]
    d = sort_probs(mx.take_along_axis(z, candidates, axis=-1), _param(rows, "temperature"))
    return mx.take_along_axis(candidates, _draw_filtered(d, rows, u)[:, None], axis=-1)[:, 0].astype(mx.int32)


def _sample_nucleus(z: mx.array, rows: Sequence[RowInput], u: mx.array) -> mx.array:
    """Rows with top-p and no top-k: the whole vocabulary sorted, top-p, min-p."""
    return _draw_filtered(sort_probs(z, _param(rows, "temperature")), rows, u)


def _sample_plain(z: mx.array, rows: Sequence[RowInput], u: mx.array) -> mx.array:
    """Rows with neither top-k nor top-p: temperature and min-p need no sort (a draw in token-id
    order has the same distribution)."""
    probs = tempered_probs(z, _param(rows, "temperature"))
    if any(_min_p in r.chain.filters for r in rows):
        threshold = _param(rows, "min_p") * probs.max(axis=-1)
        probs = mx.where(probs >= threshold[:, None], probs, 0.0)
    return draw_unsorted(probs, u)


def _group(chain: "Chain") -> tuple:
    """Rows batched into one sampler call: same sampler (and, for top-k, the same k), so that
    no row's arithmetic depends on its batchmates."""
    return (chain.sampler, chain.params.top_k if chain.sampler is _sample_top_k else 0)


def sample(x: mx.array, rows: Sequence[RowInput], u: np.ndarray | None = None) -> mx.array:
    """``x`` (B, V) processed logits -> (B,) int32 tokens: argmax for greedy rows, the chain's
    sampler and one uniform for sampled rows (``u``: one per sampled row, in row order; None:
    drawn from each sampled row's ``rng``)."""
    tokens = mx.argmax(x, axis=-1).astype(mx.int32)
    sampled = [i for i, r in enumerate(rows) if not r.chain.greedy]
    if not sampled:
        return tokens
    if u is None:
        u = np.array([_rng(rows[i]).random() for i in sampled])
    draws = dict(zip(sampled, np.asarray(u, dtype=np.float64).tolist()))
    groups: dict[tuple, list[int]] = {}
    for i in sampled:
        groups.setdefault(_group(rows[i].chain), []).append(i)
    for (sampler, _), members in groups.items():
        idx = mx.array(members, dtype=mx.int32)
        tokens[idx] = sampler(x[idx], [rows[i] for i in members], mx.array([draws[i] for i in members], dtype=mx.float32))
    return tokens


# ---- logprobs ------------------------------------------------------------------------------


@dataclass
class Logprobs:
    """Log-probabilities of the batch rows at ``positions`` (the rows whose params ask):
    ``chosen`` (b,) float32 of the sampled tokens, and per group of rows asking the same N > 0
    (``tops``: their indices into ``positions``, ids (g, N) int32, values (g, N) float32) the N
    most probable tokens, descending."""

    positions: list[int]
    chosen: mx.array
    tops: list[tuple[list[int], mx.array, mx.array]] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        """Every device array held (``chosen``, then each group's ids and values), to evaluate."""
        return [self.chosen] + [a for _, ids, vals in self.tops for a in (ids, vals)]

    def to_host(self) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
        """Per asking row: (chosen logprob, top-N (token id, logprob) pairs, blocked tokens (-inf) left out)."""
        top: list[tuple[tuple[int, float], ...]] = [()] * len(self.positions)
        for members, ids, vals in self.tops:
            for j, i_row, v_row in zip(members, np.array(ids).tolist(), np.array(vals).tolist()):
                top[j] = tuple((t, v) for t, v in zip(i_row, v_row) if v != _NEG_INF)
        return list(zip(np.array(self.chosen).tolist(), top))


def _top_n(lp: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """The ``n`` largest of ``lp`` (g, V), descending: (ids, values)."""
    n = min(n, lp.shape[-1])
    part = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n].astype(mx.int32)
    vals = mx.take_along_axis(lp, part, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(part, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def _logprobs(x: mx.array, rows: Sequence[RowInput], tokens: mx.array) -> Logprobs | None:
    use = [i for i, r in enumerate(rows) if r.chain.params.logprobs is not None]
    if not use:
        return None
    idx = mx.array(use, dtype=mx.int32)
    sub = x[idx].astype(mx.float32)
    lp = sub - mx.logsumexp(sub, axis=-1, keepdims=True)
    out = Logprobs(use, mx.take_along_axis(lp, tokens[idx][:, None], axis=-1)[:, 0])
    by_n: dict[int, list[int]] = {}
    for j, i in enumerate(use):
        if n := rows[i].chain.params.logprobs:
            by_n.setdefault(n, []).append(j)
    for n, members in by_n.items():  # one call per N: a row's top-N never depends on its batchmates
        out.tops.append((members, *_top_n(lp[mx.array(members, dtype=mx.int32)], n)))
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
        _needed(history).record(mx.array([rows[i].row for i in penalized], dtype=mx.int32),
                       tokens[mx.array(penalized, dtype=mx.int32)])
    if out.logprobs is not None:
        out.pending += out.logprobs.arrays()
    return out
