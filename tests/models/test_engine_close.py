"""Engine.close releases the KV cache on the caller's thread, and a stopping Serving calls it on
the partition's own thread (not in whichever thread's garbage collection)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import Engine, EngineConfig
from mlx_serving.models.text_generation import GenerationBackend
from mlx_serving.models.generation import SamplingParams
from mlx_serving.models.decoder.layers import State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(300)  # ends a hang only


@pytest.mark.parametrize("bucket", [False, True])
def test_close_frees_the_kv_cache_memory_and_refuses_further_use(tiny32: State, bucket: bool):
    engine = Engine(tiny32, EngineConfig.of(max_batch=2, max_len=64, prefill_chunk=8, bucket_shapes=bucket))
    engine.add(0, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()  # a step is in flight now
    held = engine.cache.nbytes
    assert held > 0 and engine.num_active == 1
    before = mx.get_active_memory()
    engine.close()
    assert engine.cache.nbytes == 0 and engine.num_active == 0
    assert before - mx.get_active_memory() >= held  # the arrays are gone, not just the attribute
    assert engine.free_slots == 0 and not engine.can_add(2, 2)
    for use in (lambda: engine.add(1, [1, 2], SamplingParams(max_new_tokens=2)), engine.step, engine.warm_up):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    engine.close()  # idempotent


def test_close_returns_the_rows_and_blocks_of_running_and_waiting_sequences(tiny32: State):
    engine = Engine(tiny32, EngineConfig.of(max_batch=1, max_len=64, prefill_chunk=8))
    engine.add(0, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8))
    engine.add(1, [6, 7, 8], SamplingParams(max_new_tokens=8))  # waits: one row
    engine.step()
    engine.step()
    assert engine.num_active == 2 and engine.num_waiting == 1 and engine.kv_stats().blocks_used > 0
    engine.close()
    stats = engine.kv_stats()
    assert engine.num_active == 0 and engine.num_waiting == 0 and stats.blocks_used == 0
    engine.cancel(1)  # unknown now: ignored


class EngineSpy:
    """Records the engines this test's servings build (``GenerationBackend.init``) and, for those
    only, each ``Engine.close`` with its thread: other tests' servings may release theirs meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.built: list[Engine] = []
        self.closed: list[tuple[str, Engine]] = []
        real_init, real_close = GenerationBackend.init, Engine.close

        def init(backend: GenerationBackend, *args: Any) -> Engine:
            engine = real_init(backend, *args)
            self.built.append(engine)
            return engine

        def close(engine: Engine) -> None:
            if any(engine is e for e in self.built):
                self.closed.append((threading.current_thread().name, engine))
            real_close(engine)

        monkeypatch.setattr(GenerationBackend, "init", init)
        monkeypatch.setattr(Engine, "close", close)

    def wait_closed(self, n: int, timeout: float = 120.0) -> list[tuple[str, Engine]]:
        deadline = time.monotonic() + timeout
        while len(self.closed) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.closed


def serving(ckpt: Path, state: State) -> Serving:
    return text_generation.serving(Tokenizer.from_dir(ckpt), state, max_len=64, max_new_tokens=3,
                                   max_batch=2, prefill_chunk=8)


def test_stopping_serving_closes_its_engine_on_the_partition_thread(tiny32_ckpt: Path, tiny32: State,
                                                                    monkeypatch: pytest.MonkeyPatch):
    spy = EngineSpy(monkeypatch)
    with Serving.start(serving(tiny32_ckpt, tiny32), name="close-me", batch_size=2, batch_timeout=0.0) as h:
        out = Serving.run(h, "hello there")
        assert out["results"][0]["num_tokens"] == 3 and spy.closed == []  # running: nothing released
    assert len(spy.built) == 1
    assert spy.closed == [("close-me-p0", spy.built[0])]  # close() joined the partition thread
    engine = spy.built[0]
    assert engine.cache.nbytes == 0
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_closing_an_inline_serving_closes_its_engine_on_its_thread(tiny32_ckpt: Path, tiny32: State,
                                                                   monkeypatch: pytest.MonkeyPatch):
    spy = EngineSpy(monkeypatch)
    gen = serving(tiny32_ckpt, tiny32)
    assert Serving.run(gen, "hello there")["results"][0]["num_tokens"] == 3
    assert len(spy.built) == 1 and spy.closed == []
    gen.close()  # returns at once; the executor thread releases after the queued runs
    gen.close()
    (name, engine), = spy.wait_closed(1)
    assert engine is spy.built[0] and name != threading.current_thread().name and engine.cache.nbytes == 0
