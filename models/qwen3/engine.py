"""Continuous (iteration-level) batching over a preallocated slot KV cache.

Sequences join free cache slots between steps and leave (freeing the slot) as soon as
they finish or are cancelled. Each :meth:`Engine.step` builds, for the whole batch,
at most one prefill forward (one chunk of up to ``prefill_chunk`` tokens for every
sequence still reading its prompt) and one decode forward (one token for every
decoding sequence, over slots ``0..hi``), enqueues them with one ``mx.async_eval``,
and only then reads the previous step's tokens to the host: the device always has the
next step queued while the host does bookkeeping (mlx-lm's ``generate_step`` pipelines
the same way). A sequence that ends on EOS therefore costs one wasted decode row.
Shapes are bucketed so that few distinct ones reach the device (on MLX's CUDA build a new
shape can mean new kernels or plans): a batch of more than one row is padded to a power-of-two
row count and its attention span rounded up to a multiple of ``_KV_BUCKET``; padding rows and
tokens have ``n_valid`` 0, write only the scratch column and are never attended, so outputs do
not change.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from .cache import KVCache, budget_slots, init_kv_cache
from .loader import State
from ..registry import family_model
from .model import Rows
from .events import FinishReason, SeqEvent
from .sampling import SamplerKind, SamplingParams, greedy, sample_top_p

__all__ = ["Engine"]

_KV_BUCKET = 256  # compiled decode: attention span granularity (tokens)


@dataclass(eq=False)
class _Seq:
    """One added sequence: the engine's only per-sequence record (``admitted``: perf_counter
    seconds at ``add``)."""

    seq_id: int
    prompt: np.ndarray
    params: SamplingParams
    rng: np.random.Generator
    admitted: float
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the cache
    scheduled: int = 0  # new tokens whose computation has been enqueued
    emitted: int = 0  # tokens returned as events
    done: bool = False

    @property
    def decoding(self) -> bool:
        return self.scheduled >= 1 and self.scheduled < self.params.max_new_tokens


@dataclass
class _Flight:
    """One enqueued step: the slot token array after it, and who got a token."""

    tokens: mx.array
    produced: list[_Seq] = field(default_factory=list)


class Engine:
    """Continuous-batching generator for one loaded Qwen3 :class:`State`.

    ``max_batch`` slots of ``max_len`` tokens each (prompt + new tokens), or fewer
    slots when ``kv_cache_bytes`` caps the cache; ``prefill_chunk`` prompt tokens per
    sequence per step. ``kv_cache`` reuses a cache from :func:`init_kv_cache` (its
    ``max_len`` wins). ``compile_decode`` runs decode steps through ``mx.compile``d
    graphs, one per padded row count (and, off the fused path, per attention span rounded
    up to a multiple of ``_KV_BUCKET``); None (default) means on with the fused CUDA decode
    path (model.decode_path), where a traced step saves the host graph building that
    bounds one-stream decode (bench/gpu_step.py), and off elsewhere. ``bucket_shapes``
    pads batches to the shape buckets described in the module docstring; None (default)
    means on for a GPU, off on the CPU, where a padded row costs as much as a real one and
    there are no per-shape kernel builds to avoid. :meth:`warm_up` runs every bucket once.
    Raises ValueError when the budget holds no slot at all.
    Not thread-safe: drive it from one thread.
    """

    def __init__(self, state: State, max_batch: int, max_len: int, prefill_chunk: int = 512,
                 kv_cache_bytes: int | None = None, *, kv_cache: KVCache | None = None,
                 compile_decode: bool | None = None, bucket_shapes: bool | None = None):
        if max_batch < 1 or max_len < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch, max_len and prefill_chunk must be >= 1, got "
                             f"{max_batch}, {max_len}, {prefill_chunk}")
        slots = max_batch
        if kv_cache_bytes is not None:
            slots = min(slots, budget_slots(state, max_len, kv_cache_bytes))
        if kv_cache is None:
            kv_cache = init_kv_cache(state, max_len, slots)
        kv_cache.lengths[:] = 0
        self.state, self.cache, self.prefill_chunk = state, kv_cache, prefill_chunk
        self.max_len = kv_cache.max_len
        self._slots: list[_Seq | None] = [None] * min(slots, kv_cache.slots)
        self._waiting: deque[_Seq] = deque()
        self._by_id: dict[int, _Seq] = {}
        self._tokens = mx.zeros((len(self._slots),), dtype=mx.int32)
        self._flight: _Flight | None = None
        self._model = family_model(state)  # the family's forward pass
        self._fused = self._model.decode_path(state) == "fused"
        if compile_decode is None:
            compile_decode = self._fused
        self._compiled: dict[tuple[int, int], Callable[..., tuple]] | None = {} if compile_decode else None
        self._bucket = mx.default_device() == mx.gpu if bucket_shapes is None else bucket_shapes

    # ---- admission -------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        """Sequences added and not yet finished or cancelled (waiting ones included)."""
        return len(self._by_id)

    @property
    def free_slots(self) -> int:
        """How many more sequences would get a cache slot right now (0 when added
        sequences are already waiting for one)."""
        return max(0, sum(s is None for s in self._slots) - len(self._waiting))

    def can_add(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a sequence of this size fits and a slot is free now."""
        return self._fits(prompt_len, max_new_tokens) and self.free_slots > 0

    def _fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        return 1 <= prompt_len and prompt_len + max_new_tokens <= self.max_len

    def add(self, seq_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queue a sequence; it takes a slot at the next step (FIFO when all are busy).
        Its events' ``elapsed_ms`` count from this call.

        Raises ValueError for a duplicate ``seq_id``, ``params`` that are not a
        :class:`SamplingParams`, prompt ids that are not integers (bools, floats, strings, ints
        past int64), an empty prompt, ids outside the vocabulary, or
        ``len(prompt_ids) + max_new_tokens > max_len`` (never fits). Nothing is queued then.
        """
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
        seq = _Seq(seq_id, prompt.astype(np.int32), params, np.random.default_rng(seed), time.perf_counter())
        self._by_id[seq_id] = seq
        self._waiting.append(seq)

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence now and free its slot; unknown or finished ids are ignored."""
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self._finish(seq)

    def _finish(self, seq: _Seq) -> None:
        seq.done = True
        del self._by_id[seq.seq_id]
        if seq.slot >= 0:
            self._slots[seq.slot] = None
        else:
            self._waiting.remove(seq)

    def _admit(self) -> None:
        for slot, occupant in enumerate(self._slots):
            if not self._waiting:
                return
            if occupant is None:
                seq = self._waiting.popleft()
                seq.slot, self._slots[slot] = slot, seq
                self.cache.lengths[slot] = 0

    def warm_up(self) -> None:
        """Run every decode shape this engine can use once, plus one small prefill, so that
        MLX's per-shape work (kernel builds, traces of the compiled decode; seconds each on
        MLX's CUDA build) happens now and not inside a request's time to first token.

        Only padding rows take part (``n_valid`` 0): no sequence and no valid cache position
        changes. Does nothing without shape bucketing (the CPU default), where shapes are
        not a small known set. Raises RuntimeError when sequences are active.
        """
        if self._by_id:
            raise RuntimeError("warm_up() needs an engine with no active sequences")
        if not self._bucket:
            return
        n = len(self._slots)
        span = self._span(1)  # the first span bucket (the fused path ignores it)
        for hi in sorted({min(n, _pow2(k)) for k in range(1, n + 1)}):
            zeros = np.zeros(hi, dtype=np.int32)
            if self._compiled is not None:
                logits = self._decode_compiled(hi, zeros, zeros, span)
            else:
                rows = Rows(self._tokens[:hi, None], None, mx.array(zeros), mx.array(zeros), span,
                            mx.array(zeros), dense=hi == 1)
                logits = self._model.forward(self.state, self.cache, rows)
            mx.eval(greedy(logits))
        t = min(self.prefill_chunk, 16)
        z = mx.zeros((1,), dtype=mx.int32)
        rows = Rows(mx.zeros((1, t), dtype=mx.int32), z, z, z, 1, z)
        mx.eval(self._model.forward(self.state, self.cache, rows))

    # ---- the step --------------------------------------------------------------------

    def step(self) -> list[SeqEvent]:
        """Advance every active sequence by one step; return the new tokens' events.

        Events lag the device by one step (pipelining): the first call after an add
        usually returns nothing for that sequence.
        """
        self._admit()
        decoders = [s for s in self._slots if s is not None and s.decoding]
        prefillers = [s for s in self._slots if s is not None and s.prefilled < s.prompt.size]
        flight = _Flight(self._tokens)
        if prefillers:
            self._prefill(prefillers, flight)
        if decoders:
            self._decode(decoders, flight)
        flight.tokens = self._tokens
        if flight.produced:
            mx.async_eval(flight.tokens, *self.cache.keys, *self.cache.values)
        events = self._land(self._flight) if self._flight is not None else []
        self._flight = flight if flight.produced else None
        return events

    def _prefill(self, seqs: list[_Seq], flight: _Flight) -> None:
        chunks = [s.prompt[s.prefilled : s.prefilled + self.prefill_chunk] for s in seqs]
        t = max(len(c) for c in chunks)
        b = len(seqs)
        dense = b == 1 and len(chunks[0]) == t
        if not dense and self._bucket:  # padding rows/tokens write the scratch column only
            t, b = min(self.prefill_chunk, _pow2(t)), _pow2(b)
        tokens = np.zeros((b, t), dtype=np.int32)
        for i, c in enumerate(chunks):
            tokens[i, : len(c)] = c
        start, n_valid = np.zeros(b, dtype=np.int32), np.zeros(b, dtype=np.int32)
        start[: len(seqs)] = [s.prefilled for s in seqs]
        n_valid[: len(seqs)] = [len(c) for c in chunks]
        slots = np.full(b, seqs[0].slot, dtype=np.int32)
        slots[: len(seqs)] = [s.slot for s in seqs]
        kv_len = int((start + n_valid).max())
        rows = Rows(mx.array(tokens), mx.array(slots), mx.array(start), mx.array(n_valid),
                    self._span(kv_len) if self._bucket and not dense else kv_len,
                    mx.array(np.maximum(n_valid - 1, 0)),
                    dense=dense)
        logits = self._model.forward(self.state, self.cache, rows)
        done = []
        for i, (s, n) in enumerate(zip(seqs, n_valid)):
            s.prefilled += int(n)
            self.cache.lengths[s.slot] += int(n)
            if s.prefilled == s.prompt.size:
                done.append(i)
        if done:
            idx = mx.array(done, dtype=mx.int32)
            finished = [seqs[i] for i in done]
            self._sample(logits[idx], finished, idx_slots=[s.slot for s in finished], flight=flight)

    def _decode(self, seqs: list[_Seq], flight: _Flight) -> None:
        hi = max(s.slot for s in seqs) + 1
        if hi > 1 and self._bucket:  # padding rows have n_valid 0 (scratch write, never read)
            hi = min(len(self._slots), _pow2(hi))
        start = self.cache.lengths[:hi].astype(np.int32)
        n_valid = np.zeros(hi, dtype=np.int32)
        n_valid[[s.slot for s in seqs]] = 1
        kv_len = int((start + n_valid)[n_valid == 1].max())
        if self._compiled is None:
            if hi > 1 and self._bucket:
                kv_len = self._span(kv_len)
            rows = Rows(self._tokens[:hi, None], None, mx.array(start), mx.array(n_valid), kv_len,
                        mx.zeros((hi,), dtype=mx.int32), dense=hi == 1)
            logits = self._model.forward(self.state, self.cache, rows)
        else:
            logits = self._decode_compiled(hi, start, n_valid, kv_len)
        for s in seqs:
            self.cache.lengths[s.slot] += 1
        slot_ids = [s.slot for s in seqs]
        self._sample(logits[mx.array(slot_ids)] if len(seqs) < hi else logits, seqs,
                     idx_slots=slot_ids, flight=flight)

    def _span(self, kv_len: int) -> int:
        """Attention span rounded up to a multiple of ``_KV_BUCKET`` (at most ``max_len``)."""
        return min(self.max_len, -(-kv_len // _KV_BUCKET) * _KV_BUCKET)

    def _decode_compiled(self, hi: int, start: np.ndarray, n_valid: np.ndarray, kv_len: int) -> mx.array:
        span = 0 if self._fused else self._span(kv_len)
        fn = self._compiled.get((hi, span))
        if fn is None:
            fn = self._compiled[(hi, span)] = self._model.compiled_decode(self.state, self.max_len, span)
        logits, keys, values = fn(self._tokens[:hi, None], mx.array(start), mx.array(n_valid),
                                  self.cache.keys, self.cache.values)
        self.cache.keys[:], self.cache.values[:] = keys, values
        return logits

    def _sample(self, logits: mx.array, seqs: list[_Seq], idx_slots: list[int], flight: _Flight) -> None:
        """Sample one token per row of ``logits`` (row i belongs to ``seqs[i]``) into
        the slot token array."""
        new = greedy(logits)
        sampled = [i for i, s in enumerate(seqs) if s.params.kind is SamplerKind.TOP_P]
        if sampled:
            idx = mx.array(sampled, dtype=mx.int32)
            p = [seqs[i].params for i in sampled]
            u = [seqs[i].rng.random() for i in sampled]
            new[idx] = sample_top_p(logits[idx], mx.array([q.temperature for q in p], dtype=mx.float32),
                                    mx.array([q.top_p for q in p], dtype=mx.float32),
                                    mx.array(u, dtype=mx.float32))
        self._tokens = _put(self._tokens, idx_slots, new)
        for s in seqs:
            s.scheduled += 1
        flight.produced += seqs

    def _land(self, flight: _Flight) -> list[SeqEvent]:
        """Read a flight's tokens to the host and turn them into events."""
        host = np.array(flight.tokens)
        now = time.perf_counter()
        events = []
        for s in flight.produced:
            if s.done:
                continue
            token = int(host[s.slot])
            reason: FinishReason | None = None
            if token in s.params.eos_token_ids:
                reason = FinishReason.STOP
            elif s.emitted + 1 >= s.params.max_new_tokens:
                reason = FinishReason.LENGTH
            events.append(SeqEvent(s.seq_id, token, (now - s.admitted) * 1e3, reason))
            s.emitted += 1
            if reason is not None:
                self._finish(s)
        return events


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def _put(tokens: mx.array, slots: list[int], values: mx.array) -> mx.array:
    """A new slot token array with ``values`` at ``slots`` (``tokens`` is untouched:
    an enqueued step keeps its own snapshot)."""
    values = values if values.dtype == mx.int32 else values.astype(mx.int32)
    return mx.put_along_axis(tokens, mx.array(slots, dtype=mx.int32), values, axis=0)
