"""The seed API: ``generate(input_ids, state, ...)`` for one prompt or a batch.

A thin loop over :class:`~models.generation.engine.Engine`: every prompt is added at once,
so a batch shares each forward pass (padding masked, per-row positions) and every row
stops on its own EOS or ``max_new_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence, cast

from .config import EngineConfig
from .engine import Engine
from .events import FinishReason
from ..decoder.layers import State
from .sampling import SamplingParams

__all__ = ["generate"]


def _is_batch(input_ids: Sequence[Any]) -> bool:
    return len(input_ids) > 0 and not isinstance(input_ids[0], int) and hasattr(input_ids[0], "__len__")


def generate(input_ids: Sequence[int] | Sequence[Sequence[int]], state: State, max_new_tokens: int = 100,
             max_len: int = 2048, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None,
             profile_timing: bool = True, prefill_chunk: int = 2048,
             eos_token_ids: Sequence[int] | None = None,
             decode_path: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids``.

    ``input_ids``: one prompt (list of ints) or a batch (list of lists; lengths may
    differ). ``max_len``: positions per row (prompt + new tokens must fit).
    ``temperature``: 0 (default) is greedy, > 0 samples from the ``top_p`` nucleus at that
    temperature (``top_p`` 1: plain temperature sampling; see ``sampling``); ``seed``: an int >= 0
    for reproducible sampling (row i of a batch uses ``seed + i``).
    ``eos_token_ids``: defaults to the checkpoint's (generation_config.json). ``decode_path``: the
    engine's (:class:`~.config.DecodeConfig`; None: its default, "matmul": the exact path).

    Returns ``(token_ids, info)``. For one prompt ``token_ids`` is a list of ints (an
    EOS, when hit, is its last element) and ``info`` is ``{"timing": {"prefill_ms",
    "per_token_ms", "total_ms"}, "finish_reason": "stop" | "length"}``: prefill_ms is
    the time to the first token, per_token_ms the list of later step times (empty when
    ``profile_timing`` is False); ``finish_reason`` is a :class:`FinishReason` (a str). For a
    batch, ``token_ids`` is a list of lists and ``finish_reason`` a list. Raises ValueError for
    bad options or a prompt that does not fit (prompt length + max_new_tokens > max_len).
    """
    batch = _is_batch(input_ids)
    if batch:
        prompts = [list(p) for p in cast(Sequence[Sequence[int]], input_ids)]
    else:  # one prompt: a sequence of ids (the engine checks each is an integer)
        prompts = [list(cast(Sequence[int], input_ids))]
    eos = tuple(state.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    first = SamplingParams(max_new_tokens, temperature, top_p, seed, eos)  # validates
    params = [first if seed is None else replace(first, seed=seed + i) for i in range(len(prompts))]
    engine = Engine(state, EngineConfig.of(max_batch=len(prompts), max_len=max_len, prefill_chunk=prefill_chunk,
                                           decode_path=decode_path))
    try:  # the engine releases its KV cache here, on the caller's thread
        out, reasons, timing = _run(engine, prompts, params, profile_timing)
    finally:
        engine.close()
    if batch:
        return out, {"timing": timing, "finish_reason": reasons}
    return out[0], {"timing": timing, "finish_reason": reasons[0]}


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
         profile_timing: bool) -> tuple[list[list[int]], list[FinishReason | None], dict[str, Any]]:
    """Add every prompt, step until all are done: each row's token ids and finish reason, and the
    timing of :func:`generate` (ms)."""
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add(i, p, sp)
    out: list[list[int]] = [[] for _ in prompts]
    reasons: list[FinishReason | None] = [None] * len(prompts)
    prefill_ms, per_token, last = None, [], t0
    while engine.num_active:
        events = engine.step()
        if not events:
            continue
        now = time.perf_counter()
        if prefill_ms is None:
            prefill_ms = (now - t0) * 1e3
        elif profile_timing:
            per_token.append((now - last) * 1e3)
        last = now
        for ev in events:
            out[ev.seq_id].append(ev.token_id)
            if ev.finish_reason is not None:
                reasons[ev.seq_id] = ev.finish_reason
    timing = {"prefill_ms": prefill_ms or 0.0, "per_token_ms": per_token, "total_ms": (time.perf_counter() - t0) * 1e3}
    return out, reasons, timing
