"""Continuous-batching Engine: outputs independent of batchmates and arrival time,
slots freed at once, budget admission, chunked prefill interleaved with decode."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_serving.models.generation import Engine, EngineConfig, FinishReason, SamplingParams, SeqEvent, generate
from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 151000, n)]


REQUESTS = [  # (prompt, params) with mixed lengths and options
    (_prompt(1, 5), SamplingParams(max_new_tokens=9)),
    (_prompt(2, 23), SamplingParams(max_new_tokens=4, temperature=1.2, top_p=0.9, seed=3)),
    (_prompt(3, 1), SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=4)),
    (_prompt(4, 14), SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.5)),
    (_prompt(5, 9), SamplingParams(max_new_tokens=10, temperature=2.0, seed=9)),
]


def _solo(state, prompt, p: SamplingParams) -> list[int]:
    ids, _ = generate(prompt, state, max_new_tokens=p.max_new_tokens,
                      temperature=p.temperature, top_p=p.top_p, seed=p.seed, eos_token_ids=p.eos_token_ids)
    return ids


def _drain(engine: Engine, out: dict[int, list[int]], reasons: dict[int, str], max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not engine.num_active:
            return
        _collect(engine.step(), out, reasons)
    raise AssertionError("engine did not finish")


def _collect(events, out, reasons) -> None:
    for ev in events:
        assert ev.seq_id not in reasons, "event after the sequence finished"
        out.setdefault(ev.seq_id, []).append(ev.token_id)
        if ev.finish_reason:
            reasons[ev.seq_id] = ev.finish_reason


@pytest.fixture(scope="module")
def solo(tiny32):
    return [_solo(tiny32, prompt, p) for prompt, p in REQUESTS]


@pytest.mark.parametrize("max_batch, chunk, arrivals", [
    (8, 512, [0, 0, 0, 0, 0]),     # all at once
    (2, 4, [0, 1, 1, 3, 6]),       # staggered, queueing for slots, chunked prefill
    (3, 7, [2, 0, 5, 1, 0]),       # another order
])
@pytest.mark.parametrize("bucket", [False, True], ids=["exact-shapes", "bucketed-shapes"])
def test_output_independent_of_batchmates_and_arrival(tiny32, solo, max_batch, chunk, arrivals, bucket):
    engine = Engine(tiny32, EngineConfig.of(max_batch=max_batch, max_len=64, prefill_chunk=chunk, bucket_shapes=bucket))
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    order = sorted(range(len(REQUESTS)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.num_active:
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            engine.add(i, *REQUESTS[i])
        _collect(engine.step(), out, reasons)
        step += 1
        assert step < 200
    for i, ref in enumerate(solo):
        assert out[i] == ref, f"request {i}"
        assert reasons[i] == "length"
    assert engine.free_slots == min(max_batch, 8)


def test_eos_and_cancel_free_slots(tiny32, solo):
    prompt, params = REQUESTS[0]
    eos = solo[0][2]
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64))
    engine.add(0, prompt, SamplingParams(max_new_tokens=9, eos_token_ids=(eos,)))
    engine.add(1, *REQUESTS[3])
    engine.add(2, *REQUESTS[4])  # waits: both slots busy
    assert engine.num_active == 3 and engine.free_slots == 0 and not engine.can_add(3, 3)
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while 0 not in reasons:
        _collect(engine.step(), out, reasons)
    assert out[0] == solo[0][:3] and reasons[0] is FinishReason.STOP
    engine.cancel(1)
    engine.cancel(1)  # idempotent
    assert engine.num_active == 1
    _drain(engine, out, reasons)
    assert 1 not in reasons and len(out.get(1, [])) < 7
    assert out[2] == solo[4]  # joined a freed slot, unaffected
    assert engine.num_active == 0 and engine.free_slots == 2


def test_events_are_typed_and_timed_from_each_add(tiny32):
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64))
    engine.add(0, _prompt(1, 3), SamplingParams(max_new_tokens=6))
    steps = [engine.step() for _ in range(3)]
    engine.add(1, _prompt(2, 3), SamplingParams(max_new_tokens=6))
    while engine.num_active:
        steps.append(engine.step())
    events: list[SeqEvent] = [ev for step in steps for ev in step]
    for i in (0, 1):
        evs = [ev for ev in events if ev.seq_id == i]
        assert [ev.finish_reason for ev in evs] == [None] * 5 + [FinishReason.LENGTH]
        assert all(type(ev.token_id) is int for ev in evs)
        times = [ev.elapsed_ms for ev in evs]
        assert 0 < times[0] and times == sorted(times)
    shared = [{ev.seq_id: ev.elapsed_ms for ev in step} for step in steps]
    shared = [t for t in shared if len(t) == 2]
    assert shared and all(t[0] > t[1] for t in shared)  # each timed from its own add


def test_cancel_waiting_sequence(tiny32):
    engine = Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64))
    engine.add(0, *REQUESTS[0])
    engine.add(1, *REQUESTS[1])
    engine.cancel(1)
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    _drain(engine, out, reasons)
    assert set(out) == {0}


def test_decode_keeps_flowing_during_chunked_prefill(tiny32):
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=96, prefill_chunk=8))
    engine.add(0, _prompt(1, 3), SamplingParams(max_new_tokens=30))
    for _ in range(3):
        engine.step()
    engine.add(1, _prompt(9, 60), SamplingParams(max_new_tokens=3))  # 8 chunks of prefill
    per_step = []
    for _ in range(8):
        per_step.append({ev.seq_id for ev in engine.step()})
    assert all(0 in s for s in per_step)  # seq 0 emitted a token at every step
    assert not any(1 in s for s in per_step[:7])  # seq 1 still reading its prompt


def test_budget_and_validation(tiny32):
    per_slot = kv_bytes_per_token(tiny32) * (64 + 1)
    engine = Engine(tiny32, EngineConfig.of(max_batch=8, max_len=64, kv_cache_bytes=3 * per_slot))
    # paged: 3 x 65 tokens of budget = 12 blocks of 16; every row may start (1 block each at least)
    stats = engine.kv_stats()
    assert (stats.blocks_total, stats.blocks_free, stats.block_size) == (12, 12, 16)
    assert engine.free_slots == 8 and engine.cache.num_blocks == 13  # + the null block
    tight = Engine(tiny32, EngineConfig.of(max_batch=8, max_len=64, kv_cache_bytes=per_slot))
    assert tight.kv_stats().blocks_total == 4 and tight.free_slots == 4
    assert engine.can_add(10, 54) and not engine.can_add(10, 55)
    with pytest.raises(ValueError, match="exceeds max_len 64"):
        engine.add(0, _prompt(1, 10), SamplingParams(max_new_tokens=55))
    with pytest.raises(ValueError, match="empty"):
        engine.add(0, [], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="token ids"):
        engine.add(0, [1, 10**7], SamplingParams(max_new_tokens=5))
    engine.add(0, [1, 2], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already active"):
        engine.add(0, [1, 2], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="holds no sequence"):
        Engine(tiny32, EngineConfig.of(max_batch=8, max_len=64, kv_cache_bytes=per_slot - 1))


def test_compiled_decode_matches_eager(tiny32, solo):
    """mx.compile'd decode steps (span bucketed, idle rows masked) give the same tokens."""
    engine = Engine(tiny32, EngineConfig.of(max_batch=3, max_len=64, compile_decode=True))
    for i in (0, 3):
        engine.add(i, *REQUESTS[i])
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    _drain(engine, out, reasons)
    assert out[0] == solo[0] and out[3] == solo[3]


@pytest.mark.parametrize("prefill_chunk", [512, 16])  # 16: later-chunk prefill shapes are warmed too
def test_warm_up_changes_no_output_and_needs_an_idle_engine(tiny32, solo, prefill_chunk):
    """warm_up() runs every bucketed decode and prefill shape (traced when compiled) on padding
    rows only: later outputs equal the solo runs; it refuses to run while sequences are active."""
    engine = Engine(tiny32, EngineConfig.of(max_batch=5, max_len=64, prefill_chunk=prefill_chunk, bucket_shapes=True,
                                            compile_decode=True))
    engine.warm_up()
    stats = engine.kv_stats()
    assert stats.blocks_used == 0 and stats.blocks_free == stats.blocks_total
    for i, request in enumerate(REQUESTS):
        engine.add(i, *request)
    with pytest.raises(RuntimeError, match="no active sequences"):
        engine.warm_up()
    out: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    _drain(engine, out, reasons)
    assert [out[i] for i in range(len(REQUESTS))] == solo


def test_warm_up_in_pieces_builds_one_row_shapes_first(tiny32, solo, monkeypatch):
    """warm_up(limit) builds the next shapes in order and returns how many are left: one-row
    forwards first (a one-row decode, then every first-chunk width: what a lone first request
    meets), and a warm-up left unfinished changes no output."""
    from mlx_serving.models.decoder import layers

    engine = Engine(tiny32, EngineConfig.of(max_batch=5, max_len=64, prefill_chunk=16, bucket_shapes=True))
    rows_seen: list[int] = []
    forward = layers.forward
    monkeypatch.setattr(layers, "forward", lambda state, cache, rows, *d: rows_seen.append(rows.tokens.shape[0])
                        or forward(state, cache, rows, *d))
    total = engine.runner.warm_shapes_left
    first = 2  # a one-row decode and a one-row 16-token prefill (prefill_chunk 16: the only width)
    assert engine.warm_up(first) == total - first and rows_seen == [1] * first
    assert engine.warm_up(2) == total - first - 2 and engine.runner.warm_shapes_left == total - first - 2
    for i, request in enumerate(REQUESTS):
        engine.add(i, *request)
    out: dict[int, list[int]] = {}
    _drain(engine, out, {})
    assert [out[i] for i in range(len(REQUESTS))] == solo
    assert engine.warm_up() == 0 and engine.runner.warm_shapes_left == 0
    cpu = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64))  # no bucketing: nothing to build
    assert cpu.runner.warm_shapes_left == 0 and cpu.warm_up() == 0


def test_engine_options_are_checked_by_name(tiny32):
    """A wrong type of step budget or shape switch is refused naming the option; the fused decode
    path by name is refused where its CUDA kernels cannot run (not at the first step)."""
    for kw, name in ((dict(max_step_tokens="64"), "max_step_tokens"), (dict(max_step_tokens=True), "max_step_tokens"),
                     (dict(bucket_shapes="yes"), "bucket_shapes"), (dict(compile_decode=1), "compile_decode")):
        with pytest.raises(ValueError, match=name):
            Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64, **kw))
    from mlx_serving.models.decoder.cuda_kernels import kernels_available

    if not kernels_available():
        with pytest.raises(ValueError, match="decode_path 'fused' needs MLX's CUDA build"):
            Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64, decode_path="fused"))
