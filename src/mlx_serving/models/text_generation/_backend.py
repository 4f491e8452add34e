"""``GenerationBackend``: the continuous-batching Engine (models/generation) behind serving's IterativeBackend.

A thin adapter with no per-row state: the partition's state is its :class:`Engine`, whose
per-sequence record (keyed by the serving's row id) is the only one; each engine event becomes a
:class:`TokenEvent` (token id, time since admission, finish reason). Runs on the serving's
executor thread only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..generation import Engine, KVStats
from ..decoder.layers import State
from ..generation.protocol import ConstraintFactory
from ._events import TokenEvent
from ._inputs import Prompt
from ._options import GenerationOptions

__all__ = ["GenerationBackend"]


class GenerationBackend:
    """IterativeBackend over :class:`models.generation.Engine` (one engine, one paged KV cache per partition)."""

    def __init__(self, state: State, options: GenerationOptions, *,
                 constraint_factory: ConstraintFactory | None = None):
        self._model, self._opts, self._constraints = state, options, constraint_factory

    def init(self, mode: str, arg: object, partitions: int) -> Engine:
        """Allocate the partition's engine (its KV block pool for the ``kv_cache_bytes`` budget, or the
        default one; see docs/generation.md) and build every shape its steps can meet
        (``Engine.warm_up()``; a no-op on the CPU) before the serving reports ready, so that no
        request waits on a build."""
        o = self._opts
        engine = Engine(self._model, o.max_batch, o.max_len, o.prefill_chunk, o.kv_cache_bytes,
                        kv_cache_fraction=o.kv_cache_fraction, prefix_caching=o.prefix_caching, policy=o.policy,
                        constraint_factory=self._constraints, max_step_tokens=o.step_tokens(),
                        bucket_shapes=o.bucket_shapes, decode_path=o.decode_path)
        engine.warm_up()
        return engine

    def close(self, engine: Engine) -> None:
        """Release the partition's KV cache and compiled steps on its own thread (:meth:`Engine.close`)
        when the serving stops."""
        engine.close()

    def admit(self, engine: Engine, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]:
        """Queue rows in the engine (admission time: now); a row that can never fit is returned
        with its ValueError."""
        rejected: list[tuple[int, BaseException]] = []
        for row_id, prompt in rows:
            assert isinstance(prompt, Prompt)
            try:
                engine.add(row_id, prompt.ids, prompt.params, priority=prompt.priority)
            except ValueError as e:
                rejected.append((row_id, e))
        return rejected

    def free_slots(self, engine: Engine) -> int:
        """How many more sequences could start now (free rows bounded by free KV blocks, less those
        waiting in the engine). Never negative."""
        return engine.free_slots

    def waiting(self, engine: Engine) -> int:
        """Sequences the engine's scheduler holds and has not started: the serving hands it every
        queued row (one queue, ordered by the engine's policy) and counts these as queued."""
        return engine.num_waiting

    def stats(self, engine: Engine) -> dict[str, float]:
        """``ServingStats.backend`` of a text-generation serving: sequences running and waiting in
        the engine (``seqs_running``, ``seqs_waiting``), tokens per step (``iteration_tokens_*``,
        :class:`~..generation.iteration_stats.IterationTokens`) and the KV block and prefix-cache
        counters of :meth:`kv_stats`. Plain counters: safe from any thread."""
        seqs = {"seqs_running": engine.num_active - engine.num_waiting, "seqs_waiting": engine.num_waiting,
                "warm_shapes_left": engine.runner.warm_shapes_left, "cold_shapes": engine.runner.cold_shapes,
                **engine.iteration_tokens.stats()}
        kv = dataclasses.asdict(engine.kv_stats())
        return seqs | {name: value for name, value in kv.items() if name != "block_size"}

    def kv_stats(self, engine: Engine) -> KVStats:
        """The engine's KV block and prefix-cache counters (:class:`KVStats`: blocks used / free /
        cached, prefix queries / hits / hit tokens, preemptions, evictions) for the serving's stats."""
        return engine.kv_stats()

    def step(self, engine: Engine) -> list[tuple[int, TokenEvent, bool]]:
        """One engine step; returns ``(row_id, TokenEvent, done)``, done on a row's last event."""
        return [(ev.seq_id, TokenEvent(ev.token_id, ev.elapsed_ms, ev.finish_reason, ev.logprob, ev.top_logprobs,
                                          ev.cached_tokens),
                 ev.finish_reason is not None) for ev in engine.step()]

    def cancel(self, engine: Engine, row_ids: list[int]) -> None:
        """Drop rows now; their rows and KV blocks are free for the next admission."""
        for row_id in row_ids:
            engine.cancel(row_id)

    def active(self, engine: Engine) -> int:
        """Sequences admitted and not finished."""
        return engine.num_active
