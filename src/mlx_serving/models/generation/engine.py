"""Continuous (iteration-level) batching over a paged KV cache: the generation core's façade.

An :class:`Engine` wires three parts, vLLM v1's split: the :class:`~.scheduler.Scheduler` (waiting
and running requests, admission, the per-step token budget, preemption, prefix sharing, over a
:class:`~.kv_cache_manager.KVCacheManager`), the :class:`~.model_runner.ModelRunner` (a step's
plan into forwards and samples on the device) and the events its callers read.

Each :meth:`Engine.step` asks the scheduler for a plan, has the runner enqueue it, advances the
scheduler's counters, and only then lands the previous step's tokens on the host: the device always
has the next step queued while the host does bookkeeping. A sequence that ends on EOS therefore
costs one wasted decode row. A step after one that gave a constrained sequence (structured output)
a token first lands that token, since the sequence's next mask depends on it.

Blocks of a prompt's longest cached prefix are reused (automatic prefix caching); a running
sequence takes blocks as it grows and returns them when it finishes or is cancelled; when the pool
runs dry the policy's victim is preempted and later recomputes prompt + generated tokens (its tokens
already emitted are not emitted again, and its output does not change).

With ``config.speculative`` (n-gram prompt lookup or a draft model, :mod:`.spec_decode`), a decoding sequence may
verify a draft of k tokens in one k+1-token row of the step's forward and emit up to k + 1 tokens
at once; its outcome lands at the start of the next step (before the plan: its next draft
depends on it), as does the token of any sequence about to propose. A sequence proposes only on
evidence (:mod:`.spec_decode.adaptive`): its plainly decoded tokens, as they land, are checked
against the draft it would have made, so one whose drafts would fail keeps the pipelined plain
step. Output is the same as without
speculation: token for token greedy, and for a seeded sampled sequence too (one uniform per emitted
token, in order); a sampled sequence with a draft model keeps the distribution exactly (rejection
sampling against the draft's probabilities) and is reproducible by seed.
"""

from __future__ import annotations

import secrets
import time
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..decoder import cuda_kernels
from ..decoder.decode_backends import DecodeBackend, FusedDecode, NativeDecode, decode_backend, kv_cache_dtype_for
from .config import EngineConfig
from .events import FinishReason, SeqEvent
from .iteration_stats import IterationTokens
from ..decoder.kv_cache import PagedKVCache, init_paged_kv_cache, plan_blocks
from ..decoder.memory import wire
from .kv_cache_manager import KVCacheManager, KVStats
from .logits import make_chain
from .model_runner import Flight, Landed, ModelRunner
from .policy import make_policy
from ..decoder.layers import State
from .protocol import ConstraintFactory
from .request import Request
from .sampling import SamplingParams
from .scheduler import Scheduler
from .spec_decode import Speculator, load_draft


__all__ = ["Engine"]


class Engine:
    """Continuous-batching generator for one loaded model ``state`` (any registered family), built
    from one :class:`~.config.EngineConfig` (``config``; its three parts document every field):

    - ``config.scheduler``: ``max_batch`` rows decode at once; ``prefill_chunk`` prompt tokens per
      sequence per step; ``max_step_tokens``, the per-step token budget shared by the decode rows
      and the prefill chunks; ``policy`` ("fcfs", "priority": ``add(..., priority=)``, lower
      first, or a :class:`~.policy.Policy`) orders the waiting sequences and picks who is preempted.
    - ``config.cache``: ``max_len`` tokens (prompt + new tokens) per sequence; KV memory is a pool
      of blocks of ``block_size`` (16) tokens allocated up front for a budget (``kv_cache_bytes``,
      or ``kv_cache_fraction`` of the device's available memory, or a default: 1 GiB on the CPU,
      half the available memory on a GPU), never more than ``max_batch x ceil(max_len /
      block_size)`` blocks (:func:`~..decoder.kv_cache.plan_blocks`); ``prefix_caching`` reuses
      the blocks of cached prefixes; ``buffer_cache_bytes`` bounds MLX's buffer cache
      (process-wide, set here); ``kv_cache_dtype`` ("auto", "int8", "int4") is what the blocks
      hold, the budget planned at its bytes per block.
    - ``config.decode``: ``decode_path`` (chosen once, as :attr:`decode_backend`),
      ``compile_decode``, ``bucket_shapes`` (:meth:`warm_up` runs every bucket once; with buckets
      the step budget never cuts a chunk short: a chunk waits for a step with room, the oldest
      prefilling sequence always gets its chunk, and a cached prefix is reused in whole
      ``prefill_chunk`` multiples, so every chunk starts on a warmed shape), ``pack_prefill`` /
      ``max_causal_groups`` (how a multi-row prefill runs, :class:`~.model_runner.ModelRunner`).
    - ``config.speculative``: speculative decoding (:class:`~.config.SpeculativeConfig`; None: off);
      its counters are :meth:`spec_decode_stats`.

    Raises ValueError when the KV budget holds no sequence of ``max_len``, or for the fused decode
    path where its CUDA kernels cannot run; TypeError when ``config`` is not an EngineConfig.
    Not thread-safe: drive it from one thread.

    Sampling follows each sequence's :class:`~.sampling.SamplingParams` through its sampler chain
    (:mod:`.logits`), for the whole batch on the device. ``constraint_factory`` makes the
    :class:`~.protocol.TokenConstraint` of a sequence whose ``params.grammar`` is set.
    """

    def __init__(self, state: State, config: EngineConfig, *, constraint_factory: ConstraintFactory | None = None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig (EngineConfig.of(max_batch=..., ...)), "
                            f"got {type(config).__name__}")
        s, c, d = config.scheduler, config.cache, config.decode
        if c.buffer_cache_bytes is not None:
            mx.set_cache_limit(c.buffer_cache_bytes)  # process-wide, as MLX's cache is
        self.state, self.config = state, config
        self.decode_backend: DecodeBackend = _runnable(decode_backend(state, d.decode_path, c.kv_cache_dtype))
        kv_dtype = kv_cache_dtype_for(self.decode_backend, c.kv_cache_dtype)  # "auto" on the native path: float16
        draft = load_draft(config.speculative, state)  # its KV shares the budget
        blocks = plan_blocks(state, s.max_batch, c.max_len, c.kv_cache_bytes, c.kv_cache_fraction, c.block_size,
                             kv_dtype, draft=draft)
        bucket = d.bucketed()
        align = s.prefill_chunk if bucket and s.prefill_chunk % c.block_size == 0 else 0  # hits start on warmed shapes
        kv = KVCacheManager(blocks, c.block_size, c.prefix_caching, prefix_align=align)
        self.speculator = (Speculator.build(config.speculative, draft, blocks, c.block_size)
                           if config.speculative is not None else None)
        self.scheduler = Scheduler(s.max_batch, kv, make_policy(s.policy), s.prefill_chunk, s.max_step_tokens,
                                   whole_chunks=bucket,  # chunk starts stay on the warmed shapes
                                   speculator=self.speculator)
        compile_decode = self.decode_backend.reads_own_length if d.compile_decode is None else d.compile_decode
        backend = self.decode_backend  # on the native path the prefill runs int8 products too
        forward_state = backend.prefill_state if isinstance(backend, NativeDecode) else state
        self.runner = ModelRunner(forward_state, init_paged_kv_cache(state, blocks, c.block_size, kv_dtype), s.max_batch, c.max_len,
                                  s.prefill_chunk, self.decode_backend, compile_decode=compile_decode,
                                  bucket_shapes=bucket, pack_prefill=d.pack_prefill,
                                  max_causal_groups=d.max_causal_groups)
        wire()  # Metal: the weights and the KV pool stay resident, bounded (decoder/memory.py)
        self.iteration_tokens = IterationTokens()  # tokens per step (the serving's stats)
        self._by_id: dict[int, Request] = {}
        self._flight: Flight | None = None
        self._timed: tuple[int, bool, float] | None = None  # the flight's step, for the speculator's timer
        self._constraint_factory = constraint_factory
        self._closed = False

    @property
    def cache(self) -> PagedKVCache:
        """The paged KV cache's device arrays."""
        return self.runner.cache

    @property
    def num_active(self) -> int:
        """Sequences added and not yet finished or cancelled (waiting ones included)."""
        return len(self._by_id)

    @property
    def num_waiting(self) -> int:
        """Sequences added and not started (or preempted and not restarted)."""
        return len(self.scheduler.waiting)

    @property
    def free_slots(self) -> int:
        """How many more sequences could start now: free rows, bounded by the free KV blocks (one
        each at least), less the sequences already waiting; 0 after :meth:`close`."""
        if self._closed:
            return 0
        free = min(self.scheduler.free_rows, self.scheduler.kv.pool.available)
        return max(0, free - self.num_waiting)

    def can_add(self, prompt_len: int, max_new_tokens: int) -> bool:
        """True when a sequence of this size fits and could start now (False after :meth:`close`)."""
        return self._fits(prompt_len, max_new_tokens) and self.free_slots > 0

    def kv_stats(self) -> KVStats:
        """Block and prefix-cache counters (:class:`~.kv_cache_manager.KVStats`)."""
        return self.scheduler.kv.stats()

    def spec_decode_stats(self) -> dict[str, float]:
        """Speculative decoding counters (:meth:`~.spec_decode.SpecStats.stats`: drafts, draft
        tokens, accepted tokens, accepted tokens per draft position); {} without speculation."""
        return self.speculator.stats.stats() if self.speculator is not None else {}

    def _fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        return 1 <= prompt_len and prompt_len + max_new_tokens <= self.config.cache.max_len

    # ---- requests ----------------------------------------------------------------------

    def add(self, seq_id: int, prompt_ids: Sequence[int], params: SamplingParams, *, priority: int = 0) -> None:
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
        vocab = self.state.config.vocab_size
        prompt = _prompt_array(prompt_ids, vocab)
        if not self._fits(prompt.size, params.max_new_tokens):
            raise ValueError(f"prompt of {prompt.size} tokens + max_new_tokens {params.max_new_tokens} "
                             f"exceeds max_len {self.config.cache.max_len}")
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an integer, got {type(priority).__name__}")
        chain = make_chain(params, vocab)
        constraint = None
        if params.grammar is not None:
            if self._constraint_factory is None:
                raise ValueError("grammar needs an Engine built with a constraint_factory")
            constraint = self._constraint_factory(params.grammar, params.eos_token_ids)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        request = Request(seq_id, prompt, params, chain, np.random.default_rng(seed), time.perf_counter(),
                          constraint, priority=int(priority),
                          spec=self.speculator.new_state(params) if self.speculator is not None else None)
        self._by_id[seq_id] = request
        self.scheduler.add(request)

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence now and free its row and blocks; unknown or finished ids are ignored."""
        request = self._by_id.get(seq_id)
        if request is not None:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        del self._by_id[request.seq_id]
        self.scheduler.finish(request)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[SeqEvent]:
        """Advance every active sequence by one step; return the new tokens' events.

        Events lag the device by one step (pipelining): the first call after an add usually
        returns nothing for that sequence. Raises RuntimeError after :meth:`close`.
        """
        self._check_open()
        if self.speculator is not None:
            self.speculator.timer.start()
        events: list[SeqEvent] = []
        if self._flight is not None and (self._flight.verifies or any(
                r.constraint is not None and not r.finished for r, _ in self._flight.produced)):
            events += self._land()  # a verify's outcome / a constrained row's mask comes first
        if self._speculate() and self._flight is not None:
            events += self._land()  # a draft needs its row's last token
        plan = self.scheduler.schedule()
        if not plan.empty:
            self.iteration_tokens.observe(plan.num_scheduled_tokens)
        flight = self.runner.execute(plan)
        self.scheduler.update(plan)
        if self._flight is not None:
            events += self._land()
        self._flight = flight
        self._timed = None if self.speculator is None or flight is None else self.speculator.timer.enqueued(
            len(plan.decodes) + sum(len(v.tokens) for v in plan.verifies), bool(plan.verifies), bool(plan.prefills))
        self.scheduler.commit_blocks()
        return events

    def _land(self) -> list[SeqEvent]:
        if self._flight is None:
            return []
        flight, self._flight = self._flight, None
        landed = self.runner.land(flight)
        if self.speculator is not None:
            self.speculator.timer.landed(self._timed)
        for v in flight.verdicts:
            if self.speculator is not None and v.request.spec is not None:
                self.speculator.record(v.request.spec, v.drafted, v.accepted)
        now = time.perf_counter()
        events = []
        for t in landed:
            if t.verified and not t.request.finished:
                self.scheduler.advance(t.request)
            if (e := self._event(t, now)) is not None:
                events.append(e)
                if self.speculator is not None and t.request.spec is not None and not t.verified:
                    self.speculator.witness(t.request.spec, t.token, t.request.tokens)
        return events

    def _speculate(self) -> bool:
        """Pick the decoding rows that propose at this step (:meth:`~.spec_decode.Speculator.choose`,
        on their rates); True when any was picked."""
        if self.speculator is None:
            return False
        return self.speculator.choose([r.spec for r in self.scheduler.running if r is not None and r.decoding])

    def _event(self, t: Landed, now: float) -> SeqEvent | None:
        """A landed token as an event (None for a sequence finished or cancelled since)."""
        r = t.request
        if r.finished:
            return None
        if r.constraint is not None:
            r.constraint.accept(t.token)
        reason: FinishReason | None = None
        if t.token in r.params.eos_token_ids or (r.constraint is not None and r.constraint.is_stopped()):
            reason = FinishReason.STOP
        elif len(r.output) + 1 >= r.params.max_new_tokens:
            reason = FinishReason.LENGTH
        event = SeqEvent(r.seq_id, t.token, (now - r.admitted) * 1e3, reason, t.logprob, t.top,
                         r.num_cached_tokens if not r.output else None)
        r.output.append(t.token)
        if reason is not None:
            self._finish(r)
        return event

    # ---- start-up and shutdown ---------------------------------------------------------

    def warm_up(self, limit: int | None = None) -> int:
        """Build the next ``limit`` (None: all) of the shapes this engine's steps can meet, most
        likely first (:meth:`~.model_runner.ModelRunner.warm_shapes`: every padded decode row count,
        every first-chunk prefill, one row's later chunks), so that MLX's per-shape work happens now
        and not inside a request's time to first token; returns how many are left. The
        text-generation serving builds them all before it reports ready. Does nothing without shape
        bucketing (the CPU default). Raises RuntimeError when sequences are active or after
        :meth:`close`."""
        self._check_open()
        if self._by_id:
            raise RuntimeError("warm_up() needs an engine with no active sequences")
        return self.runner.warm_up(limit)

    def close(self) -> None:
        """Release this engine's device memory now, on the calling thread (the one that steps it):
        wait until the thread's default stream is idle (``mx.synchronize``, so the step in flight
        ends and its buffers are freed here, not when the device finishes), finish every running
        and waiting sequence without events (their rows and KV blocks are returned: ``num_active``,
        ``num_waiting`` and :meth:`kv_stats` read as for an idle engine), then drop the KV cache
        arrays, the compiled decode steps and the token buffers. MLX keeps freed buffers in its
        cache for the next engine; ``mx.clear_cache()`` returns them to the device. Afterwards
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
        for request in list(self._by_id.values()):
            self._finish(request)
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")


def _runnable(backend: DecodeBackend) -> DecodeBackend:
    """``backend``, unless it is the fused path's CUDA kernels where they cannot run: then a
    ValueError naming ``decode_path`` now, not a kernel build error at the first step."""
    if (isinstance(backend, FusedDecode) and backend.attention is cuda_kernels.decode_attention
            and not cuda_kernels.kernels_available()):
        raise ValueError("decode_path 'fused' needs MLX's CUDA build and a GPU (the CUDA kernels); "
                         "leave decode_path unset (--decode-path left out: the device's default) or use "
                         "'native' (the CPU's) or 'matmul' here")
    return backend


def _prompt_array(prompt_ids: Sequence[int], vocab: int) -> np.ndarray:
    """``prompt_ids`` as a (P,) int32 array; ValueError for non-integers, an empty prompt or ids
    outside ``[0, vocab)``."""
    try:
        prompt = np.asarray(prompt_ids).reshape(-1)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"prompt_ids must be a list of integer token ids ({e})") from None
    if prompt.size and prompt.dtype.kind not in "iu":
        raise ValueError(f"prompt_ids must be integer token ids, got {prompt.dtype} values")
    if prompt.size == 0:
        raise ValueError("empty prompt: at least one token id is needed")
    prompt = prompt.astype(np.int64)
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got {prompt.min()}..{prompt.max()}")
    return prompt.astype(np.int32)
