"""Continuous (iteration-level) batching over a paged KV cache (or, when the caller passes one,
the preallocated slot cache of the first design).

Sequences are added to a waiting queue and start between steps on a free row (``max_batch``
rows) when the KV blocks for their first prefill chunk are free; the blocks of their longest
cached prefix are reused (automatic prefix caching, :mod:`.kv_manager`). A running sequence takes
blocks on demand as it grows and returns them at once when it finishes or is cancelled. When a
step needs blocks that are not free, the newest running sequence is preempted: its blocks are
freed and it is requeued at the front of the waiting queue, to recompute prompt + generated
tokens later (its tokens already emitted are not emitted again, and its output does not change).
A waiting sequence whose prompt's next uncached block is being prefilled right now by a running
sequence (n completions of one prompt, added together) waits until that block is committed, so
the shared prompt is prefilled once and the others start with a prefix hit.

Each :meth:`Engine.step` builds, for the whole batch, at most one prefill forward (one chunk of
up to ``prefill_chunk`` tokens for every sequence still reading its prompt) and one decode
forward (one token for every decoding sequence, over rows ``0..hi``), enqueues them with one
``mx.async_eval``, and only then reads the previous step's tokens to the host: the device always
has the next step queued while the host does bookkeeping (mlx-lm's ``generate_step`` pipelines
the same way). A sequence that ends on EOS therefore costs one wasted decode row. A step that
must preempt first lands the previous step's tokens (so the preempted sequence's generated tokens
are all known).

Shapes are bucketed so that few distinct ones reach the device (on MLX's CUDA build a new
shape can mean new kernels or plans: 50-900 ms for a prefill attention shape, bench/gpu_prefill.py):
a decode batch of more than one row is padded to a power-of-two row count and its attention span
rounded up to a multiple of ``_KV_BUCKET``; a prefill to power-of-two rows and tokens (at least 16,
at most ``prefill_chunk``), its packed tokens (when packed) to 1/8 of an octave. Padding rows and tokens have
``n_valid`` 0, write only the null block (or the slot cache's scratch column) and are never
attended, so outputs do not change.

A prefill of several rows is packed where ``PACK_PREFILL`` says so (default: only without shape
bucketing): embeddings, projections and MLP run on its real tokens only (``Rows.packed``). On the
paged cache its rows are sorted by start position and rows of one start attend as a causal group
(``Rows.causal_groups``, up to ``_MAX_CAUSAL_GROUPS`` groups; past that one boolean-masked
attention call); a group's key span is its start + tokens, not bucketed.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .. import layers  # the shared decoder (models.layers imports this package: its names are read at call time)
from .attention import Rows, compiled_decode, packing
from .events import FinishReason, SeqEvent
from .decode_backends import DecodeBackend, decode_backend
from .iteration_stats import IterationTokens
from .logits import Chain, Logprobs, RowInput, TokenHistory, make_chain, sample_batch
from .protocol import ConstraintFactory, TokenConstraint
from .sampling import SamplingParams, greedy
from .slot_cache import KVCache, budget_slots, init_kv_cache
from .kv_cache import BLOCK_SIZE, PagedKVCache, init_paged_kv_cache, plan_blocks
from .kv_manager import KVManager, KVStats, SeqBlocks
from .policy import Policy, make_policy

__all__ = ["Engine"]

_KV_BUCKET = 256  # compiled decode: attention span granularity (tokens)
#: Packed (ragged) prefill: a multi-row prefill runs its projections and MLP on the real prompt
#: tokens only (``Rows.packed``), not on the padded ``(rows, tokens)`` grid. None (default): packed
#: without shape bucketing (the CPU: 1.2-1.3x faster prefill of ragged prompts, where the matmuls
#: dominate), padded with it (the H200: 0.93-0.95x at 256 prompts of 16-1,024 tokens, and the packed
#: length would add a shape axis; bench/gpu_prefill.py). True / False: always / never.
PACK_PREFILL: bool | None = None
#: Prefill attention by groups of rows that share a start position, each with the "causal" mask
#: (``Rows.causal_groups``), when a step's prefill rows have at most this many distinct starts.
_MAX_CAUSAL_GROUPS = 4
#: warm_up builds one row's later-chunk prefill shapes for chunk starts below this position only
#: (6 widths per start: a long max_len would otherwise mean hundreds of shapes at start-up).
_WARM_LATER_CHUNKS_BELOW = 4096


@dataclass(eq=False)
class _Seq:
    """One added sequence: the engine's only per-sequence record (``admitted``: perf_counter
    seconds at ``add``)."""

    seq_id: int
    prompt: np.ndarray
    params: SamplingParams
    rng: np.random.Generator
    admitted: float
    chain: Chain  # the sampler chain built from params at add
    constraint: TokenConstraint | None = None  # structured output (params.grammar)
    priority: int = 0  # lower first under the "priority" policy
    arrival: int = 0  # add counter
    slot: int = -1  # row (and, in slot mode, cache slot); -1 while waiting
    order: int = 0  # start counter: the newest running sequence is preempted first
    chunk: int = 0  # prompt tokens this step's prefill gives it (the per-step token budget)
    target: np.ndarray | None = None  # tokens to prefill: the prompt, or prompt + generated after a preemption
    prefilled: int = 0  # tokens of target in the cache
    length: int = 0  # positions whose K/V is in the cache (or enqueued)
    scheduled: int = 0  # new tokens whose computation has been enqueued
    emitted: int = 0  # tokens returned as events
    generated: list[int] = field(default_factory=list)  # tokens landed on the host
    kv: SeqBlocks = field(default_factory=SeqBlocks)
    cached: int | None = None  # prompt tokens found in the prefix cache at the first admission
    done: bool = False

    @property
    def prefilling(self) -> bool:
        return self.target is not None and self.prefilled < len(self.target)

    @property
    def decoding(self) -> bool:
        return not self.prefilling and 1 <= self.scheduled < self.params.max_new_tokens

    def stream(self) -> np.ndarray:
        """Prompt + landed generated tokens."""
        if not self.generated:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int32)])


@dataclass
class _Flight:
    """One enqueued step: the row token array after it, and who got a token."""

    tokens: mx.array
    produced: list[_Seq] = field(default_factory=list)
    logprobs: list[tuple[list[_Seq], Logprobs]] = field(default_factory=list)  # who asked, what was enqueued
    pending: list[mx.array] = field(default_factory=list)  # sampling outputs to evaluate with the step


class Engine:
    """Continuous-batching generator for one loaded model ``State`` (any registered family).

    ``max_batch`` rows decode at once; ``max_len`` tokens (prompt + new tokens) per sequence;
    ``prefill_chunk`` prompt tokens per sequence per step. KV memory is a pool of blocks of
    ``block_size`` (16) tokens allocated up front for a budget: ``kv_cache_bytes`` (absolute), or
    ``kv_cache_fraction`` of the device's available memory, or a default (1 GiB on the CPU, half
    the available memory on a GPU), never more than ``max_batch x ceil(max_len / block_size)`` blocks (see
    :mod:`.kv_cache`). ``prefix_caching`` (default on) reuses the blocks of cached prefixes.
    ``policy``: "fcfs" (default) or "priority" (:mod:`.policy`; ``add(..., priority=)``, lower
    first) orders the waiting sequences and picks who is preempted. ``max_step_tokens``: a per-step
    token budget shared by the decode rows (one token each, always scheduled) and the prefill
    chunks (given in start order from what is left); None (default): every prefilling sequence
    gets its ``prefill_chunk``.

    The slot design instead (one preallocated ``max_len`` slot per row, no preemption, no prefix
    caching) when ``kv_cache`` passes a :class:`KVCache` from ``init_kv_cache`` (its ``max_len``
    wins); ``kv_cache_bytes`` then caps the slot count. The fused CUDA decode path
    (``decode_path="fused"``) reads either: its kernel follows the block table.

    ``decode_path``: how one-token rows attend (:func:`~.decode_backends.decode_backend`: "fused",
    "matmul", "sdpa", a backend object, or None for the fused CUDA kernels where they run and fit,
    else "matmul"); chosen once, as :attr:`decode_backend`. ``compile_decode`` runs decode steps
    through ``mx.compile``d graphs, one per padded row count (and, off the fused path, per attention
    span rounded up to a multiple of ``_KV_BUCKET``); None (default) means on with the fused path
    and off elsewhere. ``bucket_shapes`` pads batches to
    the shape buckets described in the module docstring; None (default) means on for a GPU, off on
    the CPU. :meth:`warm_up` runs every bucket once. Raises ValueError when the budget holds no
    sequence of ``max_len``. Not thread-safe: drive it from one thread.

    Sampling follows each sequence's :class:`~.sampling.SamplingParams` through its sampler chain
    (:mod:`.logits`), for the whole batch on the device. ``constraint_factory`` makes the
    :class:`~.protocol.TokenConstraint` of a sequence whose ``params.grammar`` is set (structured
    output); a step after one that gave such a sequence a token first lands that token, since the
    sequence's mask depends on it.
    """

    def __init__(self, state: Any, max_batch: int, max_len: int, prefill_chunk: int = 512,
                 kv_cache_bytes: int | None = None, *, kv_cache: KVCache | None = None,
                 compile_decode: bool | None = None, bucket_shapes: bool | None = None,
                 kv_cache_fraction: float | None = None, prefix_caching: bool = True,
                 block_size: int = BLOCK_SIZE, policy: str | Policy = "fcfs",
                 max_step_tokens: int | None = None, constraint_factory: ConstraintFactory | None = None,
                 decode_path: str | DecodeBackend | None = None):
        if max_batch < 1 or max_len < 1 or prefill_chunk < 1 or block_size < 1:
            raise ValueError(f"max_batch, max_len, prefill_chunk and block_size must be >= 1, got "
                             f"{max_batch}, {max_len}, {prefill_chunk}, {block_size}")
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be None or >= 1, got {max_step_tokens}")
        self.max_step_tokens = max_step_tokens
        self.decode_backend: DecodeBackend = decode_backend(state, decode_path)
        self.state, self.prefill_chunk = state, prefill_chunk
        self._kv: KVManager | None = None
        if kv_cache is not None:  # slot design
            slots = max_batch
            if kv_cache_bytes is not None:
                slots = min(slots, budget_slots(state, max_len, kv_cache_bytes))
            if kv_cache is None:
                kv_cache = init_kv_cache(state, max_len, slots)
            kv_cache.lengths[:] = 0
            self.cache: KVCache | PagedKVCache = kv_cache
            self.max_len = kv_cache.max_len
            rows = min(slots, kv_cache.slots)
        else:
            blocks = plan_blocks(state, max_batch, max_len, kv_cache_bytes, kv_cache_fraction, block_size)
            self.cache = init_paged_kv_cache(state, blocks, block_size)
            self._kv = KVManager(blocks, block_size, prefix_caching)
            self.max_len = max_len
            rows = max_batch
        self._slots: list[_Seq | None] = [None] * rows
        if self._kv is not None:  # each row's block table (decode), kept up to date by _decode_table
            self._rows_table = np.zeros((rows, -(-self.max_len // block_size)), dtype=np.int32)
            self._rows_table_n = [0] * rows
        self._waiting: Policy = make_policy(policy)
        self.iteration_tokens = IterationTokens()  # tokens per step (the serving's stats)
        self._arrivals = 0
        self._by_id: dict[int, _Seq] = {}
        self._tokens = mx.zeros((len(self._slots),), dtype=mx.int32)
        self._flight: _Flight | None = None
        self._started = 0
        if compile_decode is None:
            compile_decode = self.decode_backend.reads_own_length
        self._compiled: dict[tuple[int, int], Callable[..., tuple]] | None = {} if compile_decode else None
        self._bucket = mx.default_device() == mx.gpu if bucket_shapes is None else bucket_shapes
        self._constraint_factory = constraint_factory
        self._history: TokenHistory | None = None  # penalty state, made for the first penalized sequence
        self._closed = False

    # ---- admission -------------------------------------------------------------------

    @property
    def paged(self) -> bool:
        """True on the paged KV cache, False on the slot design."""
        return self._kv is not None

    @property
    def num_active(self) -> int:
        """Sequences added and not yet finished or cancelled (waiting ones included)."""
        return len(self._by_id)

    @property
    def num_waiting(self) -> int:
        """Sequences added and not started (or preempted and not restarted)."""
        return len(self._waiting)

    @property
    def free_slots(self) -> int:
        """How many more sequences could start now: free rows, bounded on the paged cache by
        the free KV blocks (one each at least), less the sequences already waiting; 0 after
        :meth:`close`."""
        if self._closed:
            return 0
        free = sum(s is None for s in self._slots)
        if self._kv is not None:
            free = min(free, self._kv.pool.available)
        return max(0, free - len(self._waiting))

    def can_add(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a sequence of this size fits and could start now (False after :meth:`close`)."""
        return self._fits(prompt_len, max_new_tokens) and self.free_slots > 0

    def kv_stats(self) -> KVStats | None:
        """Block and prefix-cache counters (:class:`~.kv_manager.KVStats`); None on the slot design."""
        return self._kv.stats() if self._kv is not None else None

    def _fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        return 1 <= prompt_len and prompt_len + max_new_tokens <= self.max_len

    def add(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0) -> None:
        """Queue a sequence; it starts at a later step (in the policy's order when rows or blocks
        are short; ``priority``: lower first under the "priority" policy). Its events'
        ``elapsed_ms`` count from this call.

        Raises ValueError for a duplicate ``seq_id``, ``params`` that are not a
        :class:`SamplingParams`, prompt ids that are not integers (bools, floats, strings, ints
        past int64), an empty prompt, ids (prompt or ``logit_bias``) outside the vocabulary,
        ``len(prompt_ids) + max_new_tokens > max_len`` (never fits), a ``grammar`` without a
        ``constraint_factory``, or whatever ValueError the factory raises for the grammar.
        Nothing is queued then. Raises RuntimeError after :meth:`close`.
        """
        self._check_open()
        if seq_id in self._by_id:
            raise ValueError(f"sequence {seq_id} is already active")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        try:
            prompt = np.asarray(prompt_ids).reshape(-1)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"prompt_ids must be a list of integer token ids ({e})") from None
        if prompt.size and prompt.dtype.kind not in "iu":
            raise ValueError(f"prompt_ids must be integer token ids, got {prompt.dtype} values")
        prompt = prompt.astype(np.int64)
        if prompt.size == 0:
            raise ValueError("empty prompt: at least one token id is needed")
        if not self._fits(prompt.size, params.max_new_tokens):
            raise ValueError(f"prompt of {prompt.size} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds max_len {self.max_len}")
        vocab = self.state.config.vocab_size
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {prompt.min()}..{prompt.max()}")
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an integer, got {type(priority).__name__}")
        chain = make_chain(params, vocab)
        constraint = None
        if params.grammar is not None:
            if self._constraint_factory is None:
                raise ValueError("grammar needs an Engine built with a constraint_factory")
            constraint = self._constraint_factory(params.grammar, params.eos_token_ids)
        self._arrivals += 1
        seq = _Seq(seq_id, prompt.astype(np.int32), params, np.random.default_rng(seed), time.perf_counter(),
                   chain, constraint, priority=int(priority), arrival=self._arrivals)
        self._by_id[seq_id] = seq
        self._waiting.push(seq)

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence now and free its row and blocks; unknown or finished ids are ignored."""
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self._finish(seq)

    def _finish(self, seq: _Seq) -> None:
        seq.done = True
        del self._by_id[seq.seq_id]
        if seq.slot >= 0:
            self._release(seq)
        else:
            self._waiting.remove(seq)

    def _release(self, seq: _Seq) -> None:
        """Give back a running sequence's row and blocks."""
        self._slots[seq.slot] = None
        if self._kv is not None:
            self._kv.free(seq.kv)
            self._rows_table[seq.slot] = 0
            self._rows_table_n[seq.slot] = 0
        seq.slot = -1

    def _admit(self) -> None:
        for slot, occupant in enumerate(self._slots):
            if not self._waiting:
                return
            if occupant is not None:
                continue
            seq = self._waiting.peek()
            if seq.target is None:
                seq.target = seq.prompt
            if self._kv is not None:
                if self._prefilling_elsewhere(seq):
                    return  # the head waits for a running sequence to prefill (and commit) its prefix
                reused = self._kv.admit(seq.kv, seq.target, self.prefill_chunk)
                if reused is None:
                    return  # FCFS: the head waits for blocks
                seq.prefilled = seq.length = reused
                seq.cached = reused if seq.cached is None else seq.cached
            else:
                self.cache.lengths[slot] = 0
            self._waiting.pop()
            self._started += 1
            seq.slot, seq.order, self._slots[slot] = slot, self._started, seq
            if seq.chain.penalized:
                self._penalty_state().reset(slot, seq.prompt, seq.generated)

    def _prefilling_elsewhere(self, seq: _Seq) -> bool:
        """True when a running sequence is prefilling the first block of ``seq``'s prompt that
        the prefix cache lacks: ``seq`` then waits until that block is committed and starts with a
        prefix hit, so n completions of one prompt added together prefill it once."""
        prefilling = (r.kv for r in self._slots if r is not None and r.prefilling)
        return self._kv.prefix.prefilling_elsewhere(seq.kv, seq.target, prefilling)

    def _penalty_state(self) -> TokenHistory:
        if self._history is None:
            self._history = TokenHistory(len(self._slots), self.state.config.vocab_size)
        return self._history

    def _plan(self) -> None:
        """This step's prefill chunk of every running sequence, within ``max_step_tokens``
        (decode rows first, one token each; then prefills in start order)."""
        running = sorted((s for s in self._slots if s is not None), key=lambda s: s.order)
        budget = self.max_step_tokens if self.max_step_tokens is not None else 1 << 62
        budget -= sum(s.decoding for s in running)
        for s in running:
            s.chunk = 0
            if s.prefilling and budget > 0:
                s.chunk = min(self.prefill_chunk, len(s.target) - s.prefilled, budget)
                budget -= s.chunk

    def _need(self, seq: _Seq) -> int:
        """Positions ``seq`` holds after this step's forward."""
        if seq.prefilling:
            return seq.prefilled + seq.chunk
        return seq.length + (1 if seq.decoding else 0)

    def _reserve(self) -> list[SeqEvent]:
        """Paged cache: blocks for every running sequence's tokens of this step, oldest first;
        preempt the newest running sequences when the pool runs dry (landing the previous step
        first, so every preempted sequence's tokens are known). Returns the events landed."""
        events: list[SeqEvent] = []
        cap = self._kv.block_size
        if all(self._need(s) <= len(s.kv.blocks) * cap for s in self._slots if s is not None):
            return events  # the common step: no row crosses into a new block
        running = sorted((s for s in self._slots if s is not None), key=lambda s: s.order)
        i = 0
        while i < len(running):
            s = running[i]
            if s.done or self._kv.ensure(s.kv, self._need(s)):
                i += 1
                continue
            if self._flight is not None:
                events += self._land(self._flight)
                self._flight = None
                continue
            victim = self._waiting.victim([r for r in running if not r.done])
            self._preempt(victim)
            at = running.index(victim)
            del running[at]
            i -= at < i
        return events

    def _preempt(self, seq: _Seq) -> None:
        assert seq.scheduled == seq.emitted, "preempting a sequence with a token in flight"
        self._release(seq)
        seq.target = seq.stream()
        seq.prefilled = seq.length = 0
        self._waiting.requeue(seq)
        self._kv.preemptions += 1

    def close(self) -> None:
        """Release this engine's device memory now, on the calling thread (the one that steps it):
        wait until the thread's default stream is idle (``mx.synchronize``, so the step in flight
        ends and its buffers are freed here, not when the device finishes), finish every running
        and waiting sequence without events (their rows and KV blocks are returned: ``num_active``,
        ``num_waiting`` and :meth:`kv_stats` read as for an idle engine), then drop the KV cache
        arrays, the compiled decode steps and the token buffers. A ``kv_cache`` the caller passed in
        keeps its arrays (the engine drops only its reference). MLX keeps freed buffers in its cache
        for the next engine; ``mx.clear_cache()`` returns them to the device. Afterwards
        :meth:`add`, :meth:`step` and :meth:`warm_up` raise RuntimeError, :attr:`free_slots` is 0
        and :meth:`can_add` False. Idempotent.

        Explicit release matters on MLX's CUDA build: arrays dropped elsewhere are freed on
        whichever thread drops the last reference (or runs the garbage collector), possibly while
        another thread's engine records a CUDA graph.
        """
        if self._closed:
            return
        self._closed = True
        mx.synchronize()
        self._flight = None
        for seq in list(self._by_id.values()):
            self._finish(seq)
        self._history = None
        if self._compiled is not None:
            self._compiled.clear()
        self.cache = replace(self.cache, keys=[], values=[])
        self._tokens = mx.zeros((0,), dtype=mx.int32)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def warm_up(self) -> None:
        """Run every decode shape this engine can use once, plus every prefill shape of a first
        chunk (rows and tokens rounded up to powers of two, tokens at least 16) and of a single
        row's later chunks, so that
        MLX's per-shape work (kernel builds, traces of the compiled decode; seconds each on
        MLX's CUDA build) happens now and not inside a request's time to first token.

        Only padding rows take part (``n_valid`` 0): no sequence and no valid cache position
        changes. Does nothing without shape bucketing (the CPU default), where shapes are
        not a small known set. Raises RuntimeError when sequences are active or after :meth:`close`.
        """
        self._check_open()
        if self._by_id:
            raise RuntimeError("warm_up() needs an engine with no active sequences")
        if not self._bucket:
            return
        n = len(self._slots)
        span = self._span(1)  # the first span bucket (the fused path ignores it)
        for hi in sorted({min(n, _pow2(k)) for k in range(1, n + 1)}):
            zeros = np.zeros(hi, dtype=np.int32)
            table = np.zeros((hi, self._width(self._table_span(span))), dtype=np.int32)
            if self._compiled is not None:
                logits = self._decode_compiled(hi, zeros, zeros, span, table)
            else:
                rows = Rows(self._tokens[:hi, None], None, mx.array(zeros), mx.array(zeros), span,
                            mx.array(zeros), dense=hi == 1, block_table=self._table_arg(table))
                logits = layers.forward(self.state, self.cache, rows, self.decode_backend)
            mx.eval(greedy(logits))
        self._warm_prefill()

    def _warm_prefill(self) -> None:
        """One padding-only prefill of each (rows, tokens) bucket from position 0 (one causal
        group on the paged cache), and on the paged cache of one row at each later chunk's start
        below ``_WARM_LATER_CHUNKS_BELOW``: the attention shapes of a step's first chunks and of
        rows that start one by one. Group spans follow each start exactly, so other starts (a
        prefix-cache hit, a chunk cut by ``max_step_tokens``) and groups of several rows at a
        later start still build their shape on first use."""
        for b in sorted({_pow2(k) for k in range(1, len(self._slots) + 1)}):
            for t in self._widths(self.max_len):
                self._warm_prefill_shape(b, t, 0)
        if self._kv is None:  # slot design: no causal groups (one masked call over a bucketed span)
            return
        for start in range(self.prefill_chunk, min(self.max_len, _WARM_LATER_CHUNKS_BELOW), self.prefill_chunk):
            for t in self._widths(self.max_len - start):  # steady state: rows start one by one
                self._warm_prefill_shape(1, t, start)

    def _widths(self, room: int) -> list[int]:
        """Tokens per row of the bucketed prefills whose longest chunk holds at most ``room`` tokens."""
        return sorted({self._prefill_width(k) for k in range(1, min(self.prefill_chunk, room) + 1)})

    def _warm_prefill_shape(self, b: int, t: int, start: int) -> None:
        z = mx.zeros((b,), dtype=mx.int32)
        packed, unpacked = packing(np.zeros(b, dtype=np.int32), t, _pack_bucket(1)) if self._pack() else (None, None)
        paged = self._kv is not None
        rows = Rows(mx.zeros((b, t), dtype=mx.int32), z, mx.full((b,), start, dtype=mx.int32), z,
                    start + t if paged else self._span(t), z,
                    block_table=self._table_arg(np.zeros((b, self._width(start + t)), dtype=np.int32)),
                    packed=packed, unpacked=unpacked, causal_groups=((0, b, start),) if paged else None)
        mx.eval(layers.forward(self.state, self.cache, rows))

    def _pack(self) -> bool:
        """Whether a multi-row prefill is packed (:data:`PACK_PREFILL`)."""
        return not self._bucket if PACK_PREFILL is None else PACK_PREFILL

    def _prefill_width(self, t: int) -> int:
        """Tokens per row of a bucketed prefill whose longest chunk has ``t`` tokens."""
        return min(self.prefill_chunk, max(16, _pow2(t)))

    # ---- the step --------------------------------------------------------------------

    def step(self) -> list[SeqEvent]:
        """Advance every active sequence by one step; return the new tokens' events.

        Events lag the device by one step (pipelining): the first call after an add
        usually returns nothing for that sequence. Raises RuntimeError after :meth:`close`.
        """
        self._check_open()
        events: list[SeqEvent] = []
        if (self._constraint_factory is not None and self._flight is not None
                and any(s.constraint is not None and not s.done for s in self._flight.produced)):
            events += self._land(self._flight)  # a constrained row's mask needs its last token
            self._flight = None
        self._admit()
        self._plan()
        if self._kv is not None:
            events += self._reserve()
        decoders = [s for s in self._slots if s is not None and s.decoding]
        prefillers = [s for s in self._slots if s is not None and s.prefilling and s.chunk > 0]
        if decoders or prefillers:
            self.iteration_tokens.observe(len(decoders) + sum(s.chunk for s in prefillers))
        flight = _Flight(self._tokens)
        if prefillers:
            self._prefill(prefillers, flight)
        if decoders:
            self._decode(decoders, flight)
        flight.tokens = self._tokens
        if flight.produced:
            history = self._history.arrays() if self._history is not None else []
            mx.async_eval(flight.tokens, *flight.pending, *history, *self.cache.keys, *self.cache.values)
        if self._flight is not None:
            events += self._land(self._flight)
        self._flight = flight if flight.produced else None
        if self._kv is not None:
            bs = self._kv.block_size
            for s in self._slots:
                if s is not None and s.length // bs > s.kv.committed:  # a block may have filled
                    self._commit(s)
        return events

    def _commit(self, s: _Seq) -> None:
        """Offer ``s``'s full blocks whose tokens are known (landed) and whose K/V is written."""
        known = len(s.prompt) + len(s.generated)
        n = min(known, s.length) // self._kv.block_size
        if n > s.kv.committed:
            self._kv.prefix.commit(s.kv, n, s.stream)

    def _width(self, kv_len: int) -> int:
        """Block-table columns for an attention span of ``kv_len`` (1 on the slot design)."""
        return -(-kv_len // self._kv.block_size) if self._kv is not None else 1

    def _table(self, seqs: list[_Seq | None], rows: int, kv_len: int) -> np.ndarray:
        """``(rows, width)`` block table of ``seqs`` (None and missing rows: null block 0)."""
        width = self._width(kv_len)
        table = np.zeros((rows, width), dtype=np.int32)
        for i, s in enumerate(seqs):
            if s is not None:
                blocks = s.kv.blocks[:width]
                table[i, : len(blocks)] = blocks
        return table

    def _decode_table(self, seqs: list[_Seq], hi: int, kv_len: int) -> np.ndarray | None:
        """``(hi, width)`` block table of the decode rows ``0..hi-1`` (by row) for a span of ``kv_len``,
        from the engine's per-row table, which gets only each row's new blocks (blocks are
        append-only while a sequence runs): no per-step rebuild. None on the slot design."""
        if self._kv is None:
            return None
        for s in seqs:
            n, have = len(s.kv.blocks), self._rows_table_n[s.slot]
            if n != have:
                self._rows_table[s.slot, have:n] = s.kv.blocks[have:n]
                self._rows_table_n[s.slot] = n
        return self._rows_table[:hi, : self._width(kv_len)]

    def _table_arg(self, table: np.ndarray) -> mx.array | None:
        return mx.array(table) if self._kv is not None else None

    def _prefill(self, seqs: list[_Seq], flight: _Flight) -> None:
        seqs = sorted(seqs, key=lambda s: s.prefilled)  # rows of one start are adjacent (causal groups)
        chunks = [s.target[s.prefilled : s.prefilled + s.chunk] for s in seqs]
        t = max(len(c) for c in chunks)
        b = len(seqs)
        if self._bucket:  # padding rows/tokens write the scratch column only
            t, b = self._prefill_width(t), _pow2(b)
        dense = b == 1 and len(chunks[0]) == t
        tokens = np.zeros((b, t), dtype=np.int32)
        for i, c in enumerate(chunks):
            tokens[i, : len(c)] = c
        start, n_valid = np.full(b, seqs[-1].prefilled, dtype=np.int32), np.zeros(b, dtype=np.int32)
        start[: len(seqs)] = [s.prefilled for s in seqs]
        n_valid[: len(seqs)] = [len(c) for c in chunks]
        slots = np.full(b, seqs[0].slot, dtype=np.int32)
        slots[: len(seqs)] = [s.slot for s in seqs]
        groups = _causal_groups(start) if self._kv is not None and not dense else None
        if groups is not None:  # each group attends over its start + t positions
            span = int(start.max()) + t
        else:
            kv_len = int((start + n_valid).max())
            span = self._span(kv_len) if self._bucket and not dense else kv_len
        packed = unpacked = None
        if not dense and self._pack():  # projections and MLP on the real tokens only
            real = int(n_valid.sum())
            packed, unpacked = packing(n_valid, t, _pack_bucket(real) if self._bucket else real)
        rows = Rows(mx.array(tokens), mx.array(slots), mx.array(start), mx.array(n_valid), span,
                    mx.array(np.maximum(n_valid - 1, 0)), dense=dense,
                    block_table=self._table_arg(self._table(seqs, b, span)) if self._kv is not None else None,
                    packed=packed, unpacked=unpacked, causal_groups=groups)
        logits = layers.forward(self.state, self.cache, rows)
        done = []
        for i, (s, n) in enumerate(zip(seqs, n_valid)):
            s.prefilled += int(n)
            s.length += int(n)
            if self._kv is None:
                self.cache.lengths[s.slot] += int(n)
            if not s.prefilling:
                done.append(i)
        if done:
            idx = mx.array(done, dtype=mx.int32)
            finished = [seqs[i] for i in done]
            self._sample(logits[idx], finished, idx_slots=[s.slot for s in finished], flight=flight)

    def _decode(self, seqs: list[_Seq], flight: _Flight) -> None:
        hi = max(s.slot for s in seqs) + 1
        if hi > 1 and self._bucket:  # padding rows have n_valid 0 (scratch write, never read)
            hi = min(len(self._slots), _pow2(hi))
        n_valid = np.zeros(hi, dtype=np.int32)
        n_valid[[s.slot for s in seqs]] = 1
        if self._kv is None:
            start = self.cache.lengths[:hi].astype(np.int32)
        else:
            start = np.zeros(hi, dtype=np.int32)
            for s in seqs:
                start[s.slot] = s.length
        kv_len = int((start + n_valid)[n_valid == 1].max())
        if self._compiled is None:
            if hi > 1 and self._bucket:
                kv_len = self._span(kv_len)
            table = self._table_arg(self._decode_table(seqs, hi, kv_len)) if self._kv is not None else None
            rows = Rows(self._tokens[:hi, None], None, mx.array(start), mx.array(n_valid), kv_len,
                        mx.zeros((hi,), dtype=mx.int32), dense=hi == 1, block_table=table)
            logits = layers.forward(self.state, self.cache, rows, self.decode_backend)
        else:
            table = self._decode_table(seqs, hi, self._table_span(self._span(kv_len)))
            logits = self._decode_compiled(hi, start, n_valid, kv_len, table)
        for s in seqs:
            s.length += 1
            if self._kv is None:
                self.cache.lengths[s.slot] += 1
        slot_ids = [s.slot for s in seqs]
        self._sample(logits[mx.array(slot_ids)] if len(seqs) < hi else logits, seqs,
                     idx_slots=slot_ids, flight=flight)

    def _table_span(self, span: int) -> int:
        """Positions the block table of a compiled decode covers: ``span``, or on the fused path
        (whose kernel reads each row's own length; one compiled graph per row count) ``max_len``."""
        return self.max_len if self.decode_backend.reads_own_length else span

    def _span(self, kv_len: int) -> int:
        """Attention span rounded up to a multiple of ``_KV_BUCKET`` (at most ``max_len``)."""
        return min(self.max_len, -(-kv_len // _KV_BUCKET) * _KV_BUCKET)

    def _decode_compiled(self, hi: int, start: np.ndarray, n_valid: np.ndarray, kv_len: int,
                         table: np.ndarray) -> mx.array:
        span = 0 if self.decode_backend.reads_own_length else self._span(kv_len)
        fn = self._compiled.get((hi, span))
        block_size = self._kv.block_size if self._kv is not None else 0
        if fn is None:
            fn = self._compiled[(hi, span)] = compiled_decode(self.state, self.max_len, span, block_size,
                                                              self.decode_backend)
        args = [self._tokens[:hi, None], mx.array(start), mx.array(n_valid)]
        if self._kv is not None:
            args.append(mx.array(table))
        logits, keys, values = fn(*args, self.cache.keys, self.cache.values)
        self.cache.keys[:], self.cache.values[:] = keys, values
        return logits

    def _sample(self, logits: mx.array, seqs: list[_Seq], idx_slots: list[int], flight: _Flight) -> None:
        """Sample one token per row of ``logits`` (row i belongs to ``seqs[i]``) into the row
        token array, through the rows' sampler chains (:func:`~.logits.sample_batch`; when every
        chain is ``argmax_only``, the common step, its argmax directly, without building the
        per-row inputs: ~100 us of host time per step at 64 rows)."""
        if all(s.chain.argmax_only for s in seqs):
            self._tokens = _put(self._tokens, idx_slots, greedy(logits))
        else:
            rows = [RowInput(s.chain, s.slot, s.scheduled, _allowed(s), s.rng) for s in seqs]
            out = sample_batch(logits, rows, self._history)
            self._tokens = _put(self._tokens, idx_slots, out.tokens)
            flight.pending += out.pending
            if out.logprobs is not None:
                flight.logprobs.append(([seqs[i] for i in out.logprobs.positions], out.logprobs))
        for s in seqs:
            s.scheduled += 1
        flight.produced += seqs

    def _land(self, flight: _Flight) -> list[SeqEvent]:
        """Read a flight's tokens (and logprobs) to the host and turn them into events."""
        host = np.array(flight.tokens)
        logprobs = {s: lp for seqs, out in flight.logprobs for s, lp in zip(seqs, out.to_host())}
        now = time.perf_counter()
        events = []
        for s in flight.produced:
            if s.done:
                continue
            token = int(host[s.slot])
            reason: FinishReason | None = None
            if s.constraint is not None:
                s.constraint.accept(token)
            if token in s.params.eos_token_ids or (s.constraint is not None and s.constraint.is_stopped()):
                reason = FinishReason.STOP
            elif s.emitted + 1 >= s.params.max_new_tokens:
                reason = FinishReason.LENGTH
            lp, top = logprobs.get(s, (None, None))
            events.append(SeqEvent(s.seq_id, token, (now - s.admitted) * 1e3, reason, lp, top,
                                   s.cached if s.emitted == 0 else None))
            s.emitted += 1
            s.generated.append(token)
            if reason is not None:
                self._finish(s)
        return events


def _allowed(seq: _Seq) -> np.ndarray | None:
    """A constrained sequence's mask of allowed next tokens; when its constraint allows none,
    its EOS ids (so that it ends)."""
    if seq.constraint is None:
        return None
    allowed = np.asarray(seq.constraint.allowed(), dtype=bool)
    if not allowed.any() and seq.chain.eos_ids.size:
        allowed = allowed.copy()
        allowed[seq.chain.eos_ids] = True
    return allowed


def _causal_groups(start: np.ndarray) -> tuple[tuple[int, int, int], ...] | None:
    """``Rows.causal_groups`` of prefill rows sorted by ``start`` (B,): one ``(lo, hi, start)``
    per distinct start, or None past ``_MAX_CAUSAL_GROUPS`` (then one masked attention call is
    cheaper than many small ones)."""
    cuts = np.flatnonzero(np.diff(start)) + 1
    if len(cuts) >= _MAX_CAUSAL_GROUPS:
        return None
    bounds = [0, *cuts.tolist(), len(start)]
    return tuple((lo, hi, int(start[lo])) for lo, hi in zip(bounds, bounds[1:]))


def _pack_bucket(n: int) -> int:
    """Packed prefill tokens rounded up to 1/8 of their power-of-two bucket (at least 64): at
    most ~8 shapes per octave, at most 12.5% padding."""
    step = max(64, _pow2(n) // 8)
    return -(-n // step) * step


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def _put(tokens: mx.array, slots: list[int], values: mx.array) -> mx.array:
    """A new row token array with ``values`` at ``slots`` (``tokens`` is untouched:
    an enqueued step keeps its own snapshot)."""
    values = values if values.dtype == mx.int32 else values.astype(mx.int32)
    return mx.put_along_axis(tokens, mx.array(slots, dtype=mx.int32), values, axis=0)
