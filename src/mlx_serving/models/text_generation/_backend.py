"""``GenerationBackend``: the continuous-batching Engine (models/generation) behind serving's IterativeBackend.

A thin adapter: the partition's state is its :class:`Engine`, whose per-sequence record (keyed by
the serving's row id) is the only one kept while a row generates; each engine event becomes a
:class:`TokenEvent` (token id, time since admission, finish reason). A row asking for prompt
log-probabilities (``Prompt.prompt_logprobs``) gets them at admission, outside the engine
(``_prompt_logprobs``: a cache-free forward over its prompt), as a :class:`PromptEvent` held until
the partition's next step, which returns it before any token of the row; a row with
``Prompt.generate`` false (``max_new_tokens`` 0) never enters the engine and ends with that event.
Runs on the serving's executor threads only (each partition's engine on its own).

The model kept is the one the engines run: on the native CPU decode path, its packed model
(:attr:`~..decoder.cpu.NativeDecode.prefill_state`: the weights packed once for the int8 products,
no MLX copy of the projections), so the loaded model's arrays are freed once its caller drops it
and every partition's engine shares the packed matrices; prompt log-probabilities then run the
path's own int8 products. On every other path (the exact ``decode_path="matmul"`` included) the
loaded model itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx

from ..decoder.decode_backends import NativeDecode, decode_backend
from ..generation import Engine, EngineConfig, KVStats
from ..generation.events import FinishReason
from ..decoder.layers import State
from ..generation.protocol import ConstraintFactory
from ._events import PromptEvent, TokenEvent
from ._inputs import Prompt
from ._options import GenerationOptions
from ._prompt_logprobs import prompt_logprobs

__all__ = ["GenerationBackend", "kept_model"]


class GenerationBackend:
    """IterativeBackend over :class:`models.generation.Engine` (one engine, one paged KV cache per partition)."""

    def __init__(self, state: State, options: GenerationOptions, *,
                 constraint_factory: ConstraintFactory | None = None):
        self._model, self._opts, self._constraints = kept_model(state, options.engine), options, constraint_factory
        # per engine: rows' prompt events awaiting the next step, each with "the row ends with it"
        self._pending: dict[Engine, dict[int, tuple[PromptEvent, bool]]] = {}

    def init(self, mode: str, arg: object, partitions: int) -> Engine:
        """Allocate the partition's engine from the options' one engine configuration
        (``GenerationOptions.engine``: its KV block pool for the ``kv_cache_bytes`` budget, or the
        default one; see docs/generation.md) and build every shape its steps can meet
        (``Engine.warm_up()``; a no-op on the CPU) before the serving reports ready, so that no
        request waits on a build. Then empties MLX's buffer cache (what the load and the packing
        freed: the loaded model's arrays, when its caller has dropped it)."""
        engine = Engine(self._model, self._opts.engine, constraint_factory=self._constraints)
        engine.warm_up()
        mx.clear_cache()
        self._pending[engine] = {}
        return engine

    def close(self, engine: Engine) -> None:
        """Release the partition's KV cache and compiled steps on its own thread (:meth:`Engine.close`)
        when the serving stops."""
        self._pending.pop(engine, None)
        engine.close()

    def admit(self, engine: Engine, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]:
        """Queue rows in the engine (admission time: now); a row that can never fit is returned
        with its ValueError. A row asking for prompt log-probabilities gets them computed now (a
        forward over its prompt on this thread), emitted by the next :meth:`step`; a row that
        generates nothing does not enter the engine."""
        rejected: list[tuple[int, BaseException]] = []
        pending = self._pending[engine]
        for row_id, prompt in rows:
            assert isinstance(prompt, Prompt)
            try:
                if prompt.generate:
                    engine.add(row_id, prompt.ids, prompt.params, priority=prompt.priority)
            except ValueError as e:
                rejected.append((row_id, e))
                continue
            if prompt.prompt_logprobs is not None:
                tokens = prompt_logprobs(self._model, prompt.ids, prompt.prompt_logprobs)
                ends = not prompt.generate
                pending[row_id] = (PromptEvent(prompt.ids[0], tokens, FinishReason.LENGTH if ends else None), ends)
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
        :class:`~..generation.iteration_stats.IterationTokens`), the speculative decoding counters
        (``spec_decode_*``, with speculation on) and the KV block and prefix-cache counters of
        :meth:`kv_stats`. Plain counters: safe from any thread."""
        seqs = {"seqs_running": engine.num_active - engine.num_waiting, "seqs_waiting": engine.num_waiting,
                "warm_shapes_left": engine.runner.warm_shapes_left, "cold_shapes": engine.runner.cold_shapes,
                **engine.iteration_tokens.stats(), **engine.spec_decode_stats()}
        kv = dataclasses.asdict(engine.kv_stats())
        return seqs | {name: value for name, value in kv.items() if name != "block_size"}

    def kv_stats(self, engine: Engine) -> KVStats:
        """The engine's KV block and prefix-cache counters (:class:`KVStats`: blocks used / free /
        cached, prefix queries / hits / hit tokens, preemptions, evictions) for the serving's stats."""
        return engine.kv_stats()

    def step(self, engine: Engine) -> list[tuple[int, PromptEvent | TokenEvent, bool]]:
        """The prompt events held since the last step (``(row_id, PromptEvent, done)``), then one
        engine step: ``(row_id, TokenEvent, done)``, done on a row's last event."""
        pending = self._pending[engine]
        held: list[tuple[int, PromptEvent | TokenEvent, bool]] = []
        if pending:
            held = [(row_id, ev, ends) for row_id, (ev, ends) in pending.items()]
            pending.clear()
        if not engine.num_active:
            return held
        return held + [(ev.seq_id, TokenEvent(ev.token_id, ev.elapsed_ms, ev.finish_reason, ev.logprob,
                                              ev.top_logprobs, ev.cached_tokens),
                        ev.finish_reason is not None) for ev in engine.step()]

    def cancel(self, engine: Engine, row_ids: list[int]) -> None:
        """Drop rows now (and their held prompt events); their rows and KV blocks are free for the
        next admission."""
        pending = self._pending[engine]
        for row_id in row_ids:
            pending.pop(row_id, None)
            engine.cancel(row_id)

    def active(self, engine: Engine) -> int:
        """Sequences admitted and not finished (in the engine, or ending with a held prompt event)."""
        pending = self._pending[engine]
        return engine.num_active + (sum(ends for _, ends in pending.values()) if pending else 0)


def kept_model(state: State, config: EngineConfig) -> State:
    """The model a serving keeps for ``state`` under ``config`` (its decode path and KV dtype, as
    :class:`Engine` picks the decode backend): the native CPU path's packed model
    (:attr:`NativeDecode.prefill_state`, the projections' MLX arrays not kept) where that path
    runs, else ``state`` itself."""
    backend = decode_backend(state, config.decode.decode_path, config.cache.kv_cache_dtype)
    return backend.prefill_state if isinstance(backend, NativeDecode) else state
