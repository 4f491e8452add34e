"""``GenerationBackend``: the Qwen3 continuous-batching Engine behind serving's IterativeBackend.

Runs on the serving's executor thread only. Each step's events are plain tuples so that they
cross thread and process boundaries (``ServingPool``'s msgpack wire) unchanged:
``(token_id, finish_reason, timing)`` where ``finish_reason`` is None until the row's last
event and ``timing`` is None or ``{"prefill_ms", "decode_ms", "total_ms"}`` on that last event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..qwen3 import Engine, State
from ._inputs import Prompt
from ._options import GenerationOptions

__all__ = ["GenerationBackend", "TokenEvent"]

TokenEvent = tuple[int | None, str | None, dict[str, float] | None]


@dataclass
class _Clock:
    admitted: float
    first: float | None = None


@dataclass
class _State:
    engine: Engine
    clocks: dict[int, _Clock] = field(default_factory=dict)


class GenerationBackend:
    """IterativeBackend over :class:`models.qwen3.Engine` (one engine, one KV cache per partition)."""

    def __init__(self, state: State, options: GenerationOptions):
        self._model, self._opts = state, options

    def init(self, mode: str, arg: Any, partitions: int) -> _State:
        """Allocate the partition's engine (``max_batch`` KV slots of ``max_len`` positions)
        and warm its shapes up (Engine.warm_up: a no-op on the CPU)."""
        o = self._opts
        engine = Engine(self._model, o.max_batch, o.max_len, o.prefill_chunk, o.kv_cache_bytes)
        engine.warm_up()
        return _State(engine)

    def admit(self, state: _State, rows: list[tuple[int, Any]], partition: int) -> list[tuple[int, BaseException]]:
        """Queue rows in the engine; a row that can never fit is returned with its ValueError."""
        rejected: list[tuple[int, BaseException]] = []
        now = time.perf_counter()
        for row_id, prompt in rows:
            assert isinstance(prompt, Prompt)
            try:
                state.engine.add(row_id, prompt.ids, prompt.params)
            except ValueError as e:
                rejected.append((row_id, e))
            else:
                state.clocks[row_id] = _Clock(now)
        return rejected

    def free_slots(self, state: _State) -> int:
        """KV-cache slots free now (never negative)."""
        return max(0, state.engine.free_slots)

    def step(self, state: _State) -> list[tuple[int, TokenEvent, bool]]:
        """One engine step; returns ``(row_id, (token_id, finish_reason, timing), done)``."""
        now_events = state.engine.step()
        now = time.perf_counter()
        out: list[tuple[int, TokenEvent, bool]] = []
        for ev in now_events:
            clock = state.clocks[ev.seq_id]
            if clock.first is None:
                clock.first = now
            timing = None
            if ev.finish_reason is not None:
                del state.clocks[ev.seq_id]
                timing = _timing(clock, now) if self._opts.profile_timing else None
            out.append((ev.seq_id, (ev.token_id, ev.finish_reason, timing), ev.finish_reason is not None))
        return out

    def cancel(self, state: _State, row_ids: list[int]) -> None:
        """Drop rows now; their KV slots are free for the next admission."""
        for row_id in row_ids:
            state.engine.cancel(row_id)
            state.clocks.pop(row_id, None)

    def active(self, state: _State) -> int:
        """Sequences admitted and not finished."""
        return state.engine.num_active


def _timing(clock: _Clock, now: float) -> dict[str, float]:
    first = clock.first if clock.first is not None else now
    return {"prefill_ms": (first - clock.admitted) * 1e3, "decode_ms": (now - first) * 1e3,
            "total_ms": (now - clock.admitted) * 1e3}
