"""The model runner: turns a :class:`~.scheduler.SchedulerOutput` into forwards on the device.

:meth:`ModelRunner.execute` builds, for a plan, at most one prefill forward (every chunk) and one
decode forward (one token per decode row, over rows ``0..hi``), samples every row that gets a
token into the row token array, and enqueues it all with one ``mx.async_eval``: a
:class:`Flight`. :meth:`ModelRunner.land` reads a flight's tokens to the host later, so the device
always has the next step queued while the host does bookkeeping (mlx-lm's ``generate_step``
pipelines the same way).

Shapes are bucketed so that few distinct ones reach the device (on MLX's CUDA build a new shape can
mean new kernels or plans: 50-900 ms for a prefill attention shape, bench/gpu_prefill.py): a decode
batch of more than one row is padded to a power-of-two row count and its attention span rounded up
to a multiple of :data:`KV_BUCKET`; a prefill to power-of-two rows and tokens (at least 16, at most
``prefill_chunk``), its packed tokens (when packed) to 1/8 of an octave. Padding rows and tokens
have ``n_valid`` 0, write only the null block and are never attended, so outputs do not change.

Speculative verify rows (:class:`~.scheduler.VerifyRow`, k + 1 tokens each) run in the prefill
forward as multi-token rows starting at their cache length, like later prefill chunks, with logits
at every position (``Rows.gather``), or, where the decode backend ``verifies_as_rows`` (the native
CPU step), as k + 1 one-token rows of the decode backend (a verified position's logits bit for bit
a plain decode step's); each
position is sampled with the row's chain (:meth:`ModelRunner._verify`) and :meth:`land` accepts
the drafts' longest reproduced prefix (:func:`~.spec_decode.accepted`), puts the last emitted
token in the row token array and rewinds a sampled row's generator to one draw per emitted token.
With shape bucketing verify spans are shapes the warm-up does not build (``cold_shapes``).

A prefill of several rows is packed where ``pack_prefill`` says so (default: only without shape
bucketing): embeddings, projections and MLP run on its real tokens only (``Rows.packed``). Its rows
are sorted by start position and rows of one start attend as a causal group
(``Rows.causal_groups``, up to ``max_causal_groups`` groups; past that one boolean-masked attention
call); a group's key span is its start + tokens, not bucketed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

import mlx.core as mx
import numpy as np

from ..decoder import layers  # the shared decoder (its forward is looked up at call time: tests spy on it)
from ..decoder.attention import Rows, packing
from ..decoder.decode_backends import DecodeBackend
from ..decoder.kv_cache import PagedKVCache
from .logits import Logprobs, RowInput, TokenHistory, make_chain, sample_batch
from .request import Request
from .sampling import SamplingParams, greedy
from .scheduler import DecodeRow, PrefillChunk, SchedulerOutput, VerifyRow
from .spec_decode import accepted
from .spec_decode.verify import DraftedSpan, resample_drafted

__all__ = ["KV_BUCKET", "Flight", "Landed", "ModelRunner", "Verdict", "shape_keys"]

Span = PrefillChunk | VerifyRow

#: Compiled decode: attention span granularity (tokens).
KV_BUCKET = 256
#: warm_up builds one row's later-chunk prefill shapes for chunk starts below this position only
#: (6 widths per start: a long max_len would otherwise mean hundreds of shapes at start-up).
_WARM_LATER_CHUNKS_BELOW = 4096


@dataclass(frozen=True)
class Verdict:
    """A landed verify row: its request, how many draft tokens it ``drafted`` and how many were
    ``accepted``; it emitted ``accepted + 1`` tokens."""

    request: Request
    drafted: int
    accepted: int


@dataclass
class Flight:
    """One enqueued step: the row token array after it, who got a token in which row, and the
    logprobs asked for; ``verifies``: its verify rows with each one's generator state before its
    draws (None: greedy), and ``spec_tokens`` their samples (every position, in order);
    ``verdicts``: their outcomes, set by :meth:`ModelRunner.land`."""

    tokens: mx.array
    produced: list[tuple[Request, int]] = field(default_factory=list)
    logprobs: list[tuple[list[Request], Logprobs]] = field(default_factory=list)
    pending: list[mx.array] = field(default_factory=list)  # sampling outputs to evaluate with the step
    verifies: list[tuple[VerifyRow, Mapping[str, Any] | None]] = field(default_factory=list)
    spec_tokens: mx.array | None = None
    verdicts: list[Verdict] = field(default_factory=list)


@dataclass(frozen=True)
class Landed:
    """One sampled token on the host: its request, id, logprob and top alternatives (None unless
    asked for); ``verified``: emitted by a verify row (its counters advance as it lands)."""

    request: Request
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    verified: bool = False


class ModelRunner:
    """Forwards and sampling for one model ``state`` over a paged ``cache`` of ``rows`` batch rows
    and ``max_len`` positions per row. ``decode``: the attention backend of one-token rows,
    chosen once; ``compile_decode``: decode through ``mx.compile``d graphs (one per padded row
    count, and off the fused path per span bucket); ``bucket_shapes``: pad to the shape buckets of
    the module docstring; ``pack_prefill``: pack multi-row prefills (None: when not bucketing);
    ``max_causal_groups``: most distinct starts a prefill attends as causal groups."""

    def __init__(self, state: layers.State, cache: PagedKVCache, rows: int, max_len: int, prefill_chunk: int,
                 decode: DecodeBackend, *, compile_decode: bool, bucket_shapes: bool,
                 pack_prefill: bool | None = None, max_causal_groups: int = 4):
        self.state, self.cache, self.decode_backend = state, cache, decode
        self.rows, self.max_len, self.prefill_chunk = rows, max_len, prefill_chunk
        self.bucket = bucket_shapes
        self.pack = not bucket_shapes if pack_prefill is None else pack_prefill
        self.max_causal_groups = max_causal_groups
        self._compiled: dict[tuple[int, int], Callable[..., tuple]] | None = {} if compile_decode else None
        self._tokens = mx.zeros((rows,), dtype=mx.int32)
        self._history: TokenHistory | None = None  # penalty state, made for the first penalized request
        self._table = np.zeros((rows, -(-max_len // cache.block_size)), dtype=np.int32)  # decode rows' blocks
        self._table_n = [0] * rows
        self._warm: deque[Callable[[], None]] = deque(self.warm_shapes() if bucket_shapes else ())  # yet to build
        self._built: set[tuple] = set()  # shape parts (:func:`shape_keys`) that have run once
        self._warming = False
        #: forwards whose shape had never run before, outside :meth:`warm_up`: builds that landed on
        #: a request's path (counted only with shape bucketing, where the shapes are a known set)
        self.cold_shapes = 0

    # ---- a step ------------------------------------------------------------------------

    def execute(self, plan: SchedulerOutput) -> Flight | None:
        """Enqueue ``plan``'s forwards and samples; None when nothing gets a token."""
        for r in plan.started:
            self._start(r)
        flight = Flight(self._tokens)
        as_rows = plan.verifies if self.decode_backend.verifies_as_rows else ()
        spans: tuple[Span, ...] = (*plan.prefills, *(() if as_rows else plan.verifies))
        if spans:
            self._prefill(spans, flight)
        if as_rows:
            self._verify_as_rows(as_rows, flight)
        if plan.decodes:
            self._decode(plan.decodes, flight)
        if not flight.produced and not flight.verifies:
            return None
        flight.tokens = self._tokens
        history = self._history.arrays() if self._history is not None else []
        spec = [flight.spec_tokens] if flight.spec_tokens is not None else []
        mx.async_eval(flight.tokens, *spec, *flight.pending, *history, *self.cache.arrays())
        return flight

    def land(self, flight: Flight) -> list[Landed]:
        """A flight's tokens (and logprobs) on the host, in the order they were produced, then each
        verify row's emitted tokens (its outcome in ``flight.verdicts``). A flight with verify rows
        must land before the next step is enqueued (their last tokens enter the row token array
        here)."""
        out: list[Landed] = []
        if flight.produced:  # (a step of verify rows only reads its samples alone)
            host = np.array(flight.tokens)
            logprobs = {r: lp for reqs, lps in flight.logprobs for r, lp in zip(reqs, lps.to_host())}
            out = [Landed(r, int(host[row]), *logprobs.get(r, (None, None))) for r, row in flight.produced]
        if flight.spec_tokens is not None:
            out += self._land_verifies(flight, np.array(flight.spec_tokens))
        return out

    def _land_verifies(self, flight: Flight, samples: np.ndarray) -> list[Landed]:
        out: list[Landed] = []
        rows, last = [], []
        at = 0
        for v, rng_state in flight.verifies:
            k = len(v.draft)
            sampled = samples[at : at + k + 1]
            at += k + 1
            a = accepted(v.draft, sampled)
            if rng_state is not None:  # one draw per emitted token, as plain decoding makes
                v.request.rng.bit_generator.state = rng_state
                v.request.rng.random(a + 1)
            flight.verdicts.append(Verdict(v.request, k, a))
            out += [Landed(v.request, int(t), verified=True) for t in sampled[: a + 1]]
            rows.append(v.row)
            last.append(int(sampled[a]))
        self._tokens = _put(self._tokens, rows, mx.array(last, dtype=mx.int32))
        return out

    def _start(self, r: Request) -> None:
        """A request's new row: an empty decode block table, its penalty state, and after a
        preemption its last token (the one its first decode feeds)."""
        self._table[r.row], self._table_n[r.row] = 0, 0
        if r.chain.penalized:
            self._penalty_state().reset(r.row, r.prompt, r.output)
        if r.num_sampled:
            self._tokens = _put(self._tokens, [r.row], mx.array([r.output[-1]], dtype=mx.int32))

    def _penalty_state(self) -> TokenHistory:
        if self._history is None:
            self._history = TokenHistory(self.rows, self.state.config.vocab_size)
        return self._history

    # ---- prefill -----------------------------------------------------------------------

    def _prefill(self, chunks: tuple[Span, ...], flight: Flight) -> None:
        """One forward over every prefill chunk and verify row of the step."""
        t = max(len(c.tokens) for c in chunks)
        order: list[Span | None]
        groups: tuple[tuple[int, int, int], ...] | None
        if self.bucket:  # padding rows/tokens write the null block only
            t = self._prefill_width(t)
            order, groups = self._bucketed_rows(chunks)
        else:
            order, groups = [*sorted(chunks, key=_start)], None  # rows of one start adjacent
        b = len(order)
        real = [(i, c) for i, c in enumerate(order) if c is not None]
        dense = b == 1 and len(real[0][1].tokens) == t
        tokens, start, n_valid = np.zeros((b, t), dtype=np.int32), np.zeros(b, dtype=np.int32), np.zeros(b, dtype=np.int32)
        for i, c in real:
            tokens[i, : len(c.tokens)], start[i], n_valid[i] = c.tokens, c.start, len(c.tokens)
        if not self.bucket and not dense:
            groups = self._causal_groups(start)
        if dense:
            groups = None
        if groups is not None:  # each group attends over its start + t positions
            span = max(g[2] for g in groups) + t
        else:
            kv_len = int((start + n_valid).max())
            span = self._span(kv_len) if self.bucket and not dense else kv_len
        packed = unpacked = None
        if not dense and self.pack:  # projections and MLP on the real tokens only
            n = int(n_valid.sum())
            packed, unpacked = packing(n_valid, t, pack_bucket(n) if self.bucket else n)
        done = [(i, c) for i, c in real if isinstance(c, PrefillChunk) and c.sample]
        verify = [(i, c) for i, c in real if isinstance(c, VerifyRow)]
        gather = None
        if verify:  # logits at each sampled chunk's last token, then at every verify position
            flat = [i * t + len(c.tokens) - 1 for i, c in done]
            flat += [i * t + j for i, c in verify for j in range(len(c.tokens))]
            gather = mx.array(flat, dtype=mx.int32)
        rows = Rows(mx.array(tokens), mx.array(start), mx.array(n_valid), span,
                    mx.array(np.maximum(n_valid - 1, 0)), mx.array(self._block_table(real, b, span)),
                    dense=dense, packed=packed, unpacked=unpacked, causal_groups=groups, gather=gather)
        self._note(*shape_keys(rows))
        logits = layers.forward(self.state, self.cache, rows)
        if verify:
            self._verify(logits[len(done):], [c for _, c in verify], flight)
            logits = logits[: len(done)]
        elif done:
            logits = logits[mx.array([i for i, _ in done], dtype=mx.int32)]
        if done:
            self._sample(logits, [c.request for _, c in done], [c.row for _, c in done], flight)

    def _bucketed_rows(self, chunks: tuple[Span, ...]) -> tuple[list[Span | None], tuple[tuple[int, int, int], ...]]:
        """The rows of a bucketed prefill and their causal groups, every attention call a warmed shape:
        first chunks (start 0) as one group padded to a power-of-two row count, then each chunk
        that starts later as a one-row group, then padding rows up to a power of two in all, which
        no group covers (their attention output is zero). None marks a padding row."""
        first = [c for c in chunks if c.start == 0]
        later = sorted((c for c in chunks if c.start > 0), key=_start)
        a = pow2(len(first)) if first else 0
        order: list[Span | None] = [*first, *[None] * (a - len(first)), *later]
        order += [None] * (pow2(len(order)) - len(order))
        groups = ((0, a, 0),) if a else ()
        return order, groups + tuple((a + i, a + i + 1, c.start) for i, c in enumerate(later))

    def _causal_groups(self, start: np.ndarray) -> tuple[tuple[int, int, int], ...] | None:
        """``Rows.causal_groups`` of prefill rows sorted by ``start`` (B,): one ``(lo, hi, start)``
        per distinct start, or None past ``max_causal_groups`` (then one masked attention call is
        cheaper than many small ones)."""
        cuts = np.flatnonzero(np.diff(start)) + 1
        if len(cuts) >= self.max_causal_groups:
            return None
        bounds = [0, *cuts.tolist(), len(start)]
        return tuple((lo, hi, int(start[lo])) for lo, hi in zip(bounds, bounds[1:]))

    def _block_table(self, chunks: list[tuple[int, Span]], rows: int, span: int) -> np.ndarray:
        """``(rows, width)`` block table of the prefill rows, chunk ``c`` in row ``i`` for each
        ``(i, c)`` of ``chunks`` (other rows: null block 0)."""
        width = self._width(span)
        table = np.zeros((rows, width), dtype=np.int32)
        for i, c in chunks:
            blocks = c.request.kv.blocks[:width]
            table[i, : len(blocks)] = blocks
        return table

    def _prefill_width(self, t: int) -> int:
        """Tokens per row of a bucketed prefill whose longest chunk has ``t`` tokens."""
        return min(self.prefill_chunk, max(16, pow2(t)))

    # ---- decode ------------------------------------------------------------------------

    def _decode(self, decodes: tuple[DecodeRow, ...], flight: Flight) -> None:
        decodes = tuple(sorted(decodes, key=lambda d: d.row))  # logits come back in row order
        rows_used = [d.row for d in decodes]
        hi = max(rows_used) + 1
        if hi > 1 and self.bucket:  # padding rows have n_valid 0 (null-block write, never read)
            hi = min(self.rows, pow2(hi))
        n_valid, start = np.zeros(hi, dtype=np.int32), np.zeros(hi, dtype=np.int32)
        n_valid[rows_used] = 1
        start[rows_used] = [d.position for d in decodes]
        kv_len = int((start + n_valid)[n_valid == 1].max())
        if self._compiled is None:
            if hi > 1 and self.bucket:
                kv_len = self._span(kv_len)
            table = self._decode_table(decodes, hi, kv_len)
            rows = Rows(self._tokens[:hi, None], mx.array(start), mx.array(n_valid), kv_len,
                        mx.zeros((hi,), dtype=mx.int32), mx.array(table), dense=hi == 1)
            self._note(*shape_keys(rows))
            logits = layers.forward(self.state, self.cache, rows, self.decode_backend)
        else:
            table = self._decode_table(decodes, hi, self._table_span(self._span(kv_len)))
            logits = self._decode_compiled(hi, start, n_valid, kv_len, table)
        if len(decodes) < hi:
            logits = logits[mx.array(rows_used)]
        self._sample(logits, [d.request for d in decodes], rows_used, flight)

    def _verify_as_rows(self, verifies: tuple[VerifyRow, ...], flight: Flight) -> None:
        """The verify rows through the decode backend (``verifies_as_rows``): each of a row's k + 1
        tokens one decode row at its position, all sharing the row's block table, then every
        position sampled as :meth:`_verify` does."""
        tokens = np.concatenate([v.tokens for v in verifies]).astype(np.int32)
        start = np.concatenate([v.start + np.arange(len(v.tokens), dtype=np.int32) for v in verifies])
        kv_len = int(start.max()) + 1
        width = self._width(kv_len)
        table = np.zeros((len(tokens), width), dtype=np.int32)
        i = 0
        for v in verifies:
            blocks = v.request.kv.blocks[:width]
            table[i:i + len(v.tokens), : len(blocks)] = blocks
            i += len(v.tokens)
        n = len(tokens)
        rows = Rows(mx.array(tokens[:, None]), mx.array(start), mx.ones((n,), dtype=mx.int32), kv_len,
                    mx.zeros((n,), dtype=mx.int32), mx.array(table), dense=n == 1)
        self._verify(layers.forward(self.state, self.cache, rows, self.decode_backend), list(verifies), flight)

    def _decode_table(self, decodes: tuple[DecodeRow, ...], hi: int, kv_len: int) -> np.ndarray:
        """``(hi, width)`` block table of rows ``0..hi-1`` for a span of ``kv_len``, from the
        runner's per-row table, which gets only each row's new blocks (a running request's blocks
        are append-only; a row's table starts over when a request starts on it)."""
        for d in decodes:
            r, row = d.request, d.row
            n, have = len(r.kv.blocks), self._table_n[row]
            if n != have:
                self._table[row, have:n] = r.kv.blocks[have:n]
                self._table_n[row] = n
        return self._table[:hi, : self._width(kv_len)]

    def _decode_compiled(self, hi: int, start: np.ndarray, n_valid: np.ndarray, kv_len: int,
                         table: np.ndarray) -> mx.array:
        span = 0 if self.decode_backend.reads_own_length else self._span(kv_len)
        self._note(("compiled", hi, span, table.shape[1]))
        if self._compiled is None:
            raise RuntimeError("a compiled decode on a runner built without compile_decode")
        fn = self._compiled.get((hi, span))
        if fn is None:
            fn = self._compiled[(hi, span)] = layers.compiled_decode(self.state, span, self.cache,
                                                              self.decode_backend)
        logits, arrays = fn(self._tokens[:hi, None], mx.array(start), mx.array(n_valid), mx.array(table),
                            self.cache.arrays())
        self.cache.set_arrays(arrays)
        return logits

    def _note(self, *keys: tuple) -> None:
        """Record a forward's parts (:func:`shape_keys`); a part never run before counts in
        :attr:`cold_shapes` when it runs outside the warm-up. Only with bucketing, where the shapes
        are a known set (unbucketed, any length is a shape: nothing is recorded)."""
        if not self.bucket:
            return
        for key in keys:
            if key not in self._built:
                self._built.add(key)
                self.cold_shapes += not self._warming

    def _width(self, kv_len: int) -> int:
        """Block-table columns for an attention span of ``kv_len``."""
        return -(-kv_len // self.cache.block_size)

    def _table_span(self, span: int) -> int:
        """Positions the block table of a compiled decode covers: ``span``, or on the fused path
        (whose kernel reads each row's own length; one compiled graph per row count) ``max_len``."""
        return self.max_len if self.decode_backend.reads_own_length else span

    def _span(self, kv_len: int) -> int:
        """Attention span rounded up to a multiple of :data:`KV_BUCKET` (at most ``max_len``)."""
        return min(self.max_len, -(-kv_len // KV_BUCKET) * KV_BUCKET)

    # ---- sampling ----------------------------------------------------------------------

    def _sample(self, logits: mx.array, reqs: list[Request], rows: list[int], flight: Flight) -> None:
        """Sample one token per row of ``logits`` (row i belongs to ``reqs[i]`` in batch row
        ``rows[i]``) into the row token array, through the requests' sampler chains
        (:func:`~.logits.sample_batch`; when every chain is ``argmax_only``, the common step, its
        argmax directly, without building the per-row inputs: ~100 us of host time per step at 64
        rows)."""
        if all(r.chain.argmax_only for r in reqs):
            self._tokens = _put(self._tokens, rows, greedy(logits))
        else:
            inputs = [RowInput(r.chain, row, r.num_sampled, _allowed(r), r.rng) for r, row in zip(reqs, rows)]
            out = sample_batch(logits, inputs, self._history)
            self._tokens = _put(self._tokens, rows, out.tokens)
            flight.pending += out.pending
            if out.logprobs is not None:
                flight.logprobs.append(([reqs[i] for i in out.logprobs.positions], out.logprobs))
        flight.produced += zip(reqs, rows)

    def _verify(self, logits: mx.array, verifies: list[VerifyRow], flight: Flight) -> None:
        """Sample every position of each verify row (``logits`` (sum of k + 1, V), in order) with
        its request's chain, position ``j`` as the request's ``num_sampled + j``-th token (its
        min_tokens mask) with the next uniform of its generator, whose state before the draws is
        kept for :meth:`land`."""
        inputs = [RowInput(v.request.chain, v.row, v.request.num_sampled + j, None, v.request.rng)
                  for v in verifies for j in range(len(v.tokens))]
        flight.verifies += [(v, None if v.request.chain.greedy or _draft_probs(v) is not None
                             else v.request.rng.bit_generator.state) for v in verifies]
        if all(v.request.chain.argmax_only for v in verifies):
            flight.spec_tokens = greedy(logits)
        else:
            flight.spec_tokens = resample_drafted(logits, sample_batch(logits, inputs).tokens,
                                                  _drafted_spans(verifies, inputs))

    # ---- start-up and shutdown ---------------------------------------------------------

    def warm_up(self, limit: int | None = None) -> int:
        """Build the next ``limit`` (None: every) pending shape of :meth:`warm_shapes`, in its
        order, and return how many are left; MLX's buffer cache is emptied once none is. Only
        padding rows take part (``n_valid`` 0): no valid cache position changes. Builds nothing
        without shape bucketing (the CPU default), where shapes are not a small known set."""
        n = len(self._warm) if limit is None else min(limit, len(self._warm))
        self._warming = True
        try:
            for _ in range(n):
                self._warm.popleft()()
        finally:
            self._warming = False
        if n and not self._warm:
            mx.clear_cache()  # the warm-up's transient buffers go back to the device
        return len(self._warm)

    @property
    def warm_shapes_left(self) -> int:
        """Shapes :meth:`warm_up` has yet to build (a plain counter: safe from any thread)."""
        return len(self._warm)

    def warm_shapes(self) -> list[Callable[[], None]]:
        """Every shape a step can meet that MLX builds per shape (kernel builds, traces of the
        compiled decode; seconds each on MLX's CUDA build), most likely first: a one-row decode,
        one-row first-chunk prefills, every padded decode row count, multi-row first chunks, then
        one row's later chunks below ``_WARM_LATER_CHUNKS_BELOW``: with bucketing a prefill's
        attention calls are only these (:meth:`_bucketed_rows`; chunks start at multiples of
        ``prefill_chunk``: the scheduler's whole chunks and aligned prefix hits)."""
        decodes = sorted({min(self.rows, pow2(k)) for k in range(1, self.rows + 1)})
        batches = sorted({pow2(k) for k in range(1, self.rows + 1)})
        widths = self._widths(self.max_len)
        shapes: list[Callable[[], None]] = [partial(self._warm_decode, 1)]
        shapes += [partial(self._warm_prefill_shape, 1, t, 0) for t in widths]
        shapes += [partial(self._warm_decode, hi) for hi in decodes[1:]]
        shapes += [partial(self._warm_prefill_shape, b, t, 0) for b in batches[1:] for t in widths]
        for start in range(self.prefill_chunk, min(self.max_len, _WARM_LATER_CHUNKS_BELOW), self.prefill_chunk):
            shapes += [partial(self._warm_prefill_shape, 1, t, start) for t in self._widths(self.max_len - start)]
        return shapes

    def _warm_decode(self, hi: int) -> None:
        span = self._span(1)  # the first span bucket (the fused path ignores it)
        zeros = np.zeros(hi, dtype=np.int32)
        table = np.zeros((hi, self._width(self._table_span(span))), dtype=np.int32)
        if self._compiled is not None:
            logits = self._decode_compiled(hi, zeros, zeros, span, table)
        else:
            rows = Rows(self._tokens[:hi, None], mx.array(zeros), mx.array(zeros), span, mx.array(zeros),
                        mx.array(table), dense=hi == 1)
            self._note(*shape_keys(rows))
            logits = layers.forward(self.state, self.cache, rows, self.decode_backend)
        mx.eval(self._warm_sampling(logits))

    def _warm_sampling(self, logits: mx.array) -> list[mx.array]:
        """What a step's sampling evaluates, on ``logits`` (B, vocab) of padding rows: a gathered
        row's argmax put into the row token array (a copy: the runner's is untouched) and every
        row sampled at temperature 1 with top-p and top-k, so that MLX's first use of those
        kernels falls in the warm-up too."""
        sub = logits[mx.array([0], dtype=mx.int32)]
        chain = make_chain(SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9, top_k=40),
                           self.state.config.vocab_size)
        rng = np.random.default_rng(0)
        out = sample_batch(logits, [RowInput(chain, i, 0, None, rng) for i in range(logits.shape[0])])
        return [_put(self._tokens, [0], greedy(sub)), out.tokens, *out.pending]

    def _widths(self, room: int) -> list[int]:
        """Tokens per row of the bucketed prefills whose longest chunk holds at most ``room`` tokens."""
        return sorted({self._prefill_width(k) for k in range(1, min(self.prefill_chunk, room) + 1)})

    def _warm_prefill_shape(self, b: int, t: int, start: int) -> None:
        z = mx.zeros((b,), dtype=mx.int32)
        packed, unpacked = packing(np.zeros(b, dtype=np.int32), t, pack_bucket(1)) if self.pack else (None, None)
        rows = Rows(mx.zeros((b, t), dtype=mx.int32), mx.full((b,), start, dtype=mx.int32), z, start + t, z,
                    mx.zeros((b, self._width(start + t)), dtype=mx.int32), packed=packed, unpacked=unpacked,
                    causal_groups=((0, b, start),))
        self._note(*shape_keys(rows))
        logits = layers.forward(self.state, self.cache, rows)
        mx.eval(self._warm_sampling(logits) if start == 0 and t == self._widths(self.max_len)[0] else logits)

    def close(self) -> None:
        """Drop the KV cache arrays, the compiled decode steps, the penalty state and the token
        buffer (the caller synchronizes the stream first)."""
        self._history = None
        if self._compiled is not None:
            self._compiled.clear()
        self.cache = self.cache.cleared()
        self._tokens = mx.zeros((0,), dtype=mx.int32)
        self._warm = deque()


def _start(c: Span) -> int:
    return c.start


def _drafted_spans(verifies: list[VerifyRow], inputs: list[RowInput]) -> list[DraftedSpan]:
    """The verify rows whose draft a draft model sampled (``spec.draft_probs`` set), as spans of
    the flat positions ``inputs`` (k + 1 per row, in order)."""
    spans, at = [], 0
    for v in verifies:
        n = len(v.tokens)
        if (q := _draft_probs(v)) is not None:
            spans.append(DraftedSpan(at, v.draft, q, inputs[at : at + n], v.request.rng))
        at += n
    return spans


def _draft_probs(v: VerifyRow) -> mx.array | None:
    """The draft distributions ``(k, V)`` of a sampled verify row whose draft a draft model
    sampled (verified by the general rejection rule, its generator never rewound), else None."""
    spec = v.request.spec
    return spec.draft_probs if spec is not None and not v.request.chain.greedy else None


def _allowed(r: Request) -> np.ndarray | None:
    """A constrained request's mask of allowed next tokens; when its constraint allows none, its
    EOS ids (so that it ends)."""
    if r.constraint is None:
        return None
    allowed = np.asarray(r.constraint.allowed(), dtype=bool)
    if not allowed.any() and r.chain.eos_ids.size:
        allowed = allowed.copy()
        allowed[r.chain.eos_ids] = True
    return allowed


def shape_keys(rows: Rows) -> list[tuple]:
    """What MLX builds per shape for a forward over ``rows`` (B, T), one key per part: the
    projections' token count (packed or ``B * T``) and each attention call, ``(rows, T, keys)`` per
    causal group or dense row (a one-token dense row: any length, MLX's vector kernel), or the
    masked call's ``(B, T, span)``."""
    b, t = rows.tokens.shape
    keys: list[tuple] = [("tokens", b * t if rows.packed is None else rows.packed.shape[0])]
    if rows.causal_groups is not None:
        keys += [("causal", hi - lo, t, start + t) for lo, hi, start in rows.causal_groups]
    elif rows.dense:
        keys.append(("causal", 1, t, rows.kv_len if t > 1 else None))
    else:
        keys.append(("masked", b, t, rows.kv_len))
    return keys


def pack_bucket(n: int) -> int:
    """Packed prefill tokens rounded up to 1/8 of their power-of-two bucket (at least 64): at most
    ~8 shapes per octave, at most 12.5% padding."""
    step = max(64, pow2(n) // 8)
    return -(-n // step) * step


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def _put(tokens: mx.array, rows: list[int], values: mx.array) -> mx.array:
    """A new row token array with ``values`` at ``rows`` (``tokens`` is untouched: an enqueued step
    keeps its own snapshot)."""
    values = values if values.dtype == mx.int32 else values.astype(mx.int32)
    return mx.put_along_axis(tokens, mx.array(rows, dtype=mx.int32), values, axis=0)
