"""Engine.close releases the KV cache on the caller's thread, and a stopping Serving calls it on
the partition's own thread (not in whichever thread's garbage collection)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import Engine
from mlx_serving.models.qwen3 import SamplingParams, State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("bucket", [False, True])
def test_close_frees_the_kv_cache_memory_and_refuses_further_use(tiny32: State, bucket: bool):
    engine = Engine(tiny32, max_batch=2, max_len=64, prefill_chunk=8, bucket_shapes=bucket)
    engine.add(0, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()  # a step is in flight now
    held = engine.cache.nbytes
    assert held > 0 and engine.num_active == 1
    before = mx.get_active_memory()
    engine.close()
    assert engine.cache.nbytes == 0 and engine.num_active == 0
    assert before - mx.get_active_memory() >= held  # the arrays are gone, not just the attribute
    assert not engine.can_add(2, 2)
    for use in (lambda: engine.add(1, [1, 2], SamplingParams(max_new_tokens=2)), engine.step, engine.warm_up):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    engine.close()  # idempotent


def test_close_returns_the_rows_and_blocks_of_running_and_waiting_sequences(tiny32: State):
    engine = Engine(tiny32, max_batch=1, max_len=64, prefill_chunk=8)
    assert engine.paged
    engine.add(0, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8))
    engine.add(1, [6, 7, 8], SamplingParams(max_new_tokens=8))  # waits: one row
    engine.step()
    engine.step()
    assert engine.num_active == 2 and engine.num_waiting == 1 and engine.kv_stats().blocks_used > 0
    engine.close()
    stats = engine.kv_stats()
    assert engine.num_active == 0 and engine.num_waiting == 0 and stats.blocks_used == 0
    engine.cancel(1)  # unknown now: ignored


def test_stopping_serving_closes_its_engine_on_the_partition_thread(tiny32_ckpt: Path, tiny32: State,
                                                                    monkeypatch: pytest.MonkeyPatch):
    closed: list[tuple[str, Engine]] = []
    real_close = Engine.close

    def spy(self: Engine) -> None:
        closed.append((threading.current_thread().name, self))
        real_close(self)

    monkeypatch.setattr(Engine, "close", spy)
    gen = text_generation.serving(Tokenizer.from_dir(tiny32_ckpt), tiny32, max_len=64, max_new_tokens=3,
                                  max_batch=2, prefill_chunk=8)
    with Serving.start(gen, name="close-me", batch_size=2, batch_timeout=0.0) as h:
        out = Serving.run(h, "hello there")
        assert out["results"][0]["num_tokens"] == 3 and closed == []  # running: nothing released
    assert [name for name, _ in closed] == ["close-me-p0"]
    engine = closed[0][1]
    assert engine.cache.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_closing_an_inline_serving_closes_its_engine_on_its_thread(tiny32_ckpt: Path, tiny32: State,
                                                                   monkeypatch: pytest.MonkeyPatch):
    closed: list[tuple[str, Engine]] = []
    real_close = Engine.close

    def spy(self: Engine) -> None:
        closed.append((threading.current_thread().name, self))
        real_close(self)

    monkeypatch.setattr(Engine, "close", spy)
    gen = text_generation.serving(Tokenizer.from_dir(tiny32_ckpt), tiny32, max_len=64, max_new_tokens=3,
                                  max_batch=2, prefill_chunk=8)
    assert Serving.run(gen, "hello there")["results"][0]["num_tokens"] == 3
    assert closed == []
    gen.close()  # returns at once; the executor thread releases after the queued runs
    gen.close()
    deadline = time.monotonic() + 10
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    (name, engine), = closed
    assert name != threading.current_thread().name and engine.cache.nbytes == 0
