"""Engine.close releases the KV cache on the caller's thread, and a stopping Serving calls it on
the partition's own thread (not in whichever thread's garbage collection)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import Engine
from mlx_serving.models.qwen3 import SamplingParams, State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("bucket", [False, True])
def test_close_drops_the_kv_cache_and_refuses_further_use(tiny32: State, bucket: bool):
    engine = Engine(tiny32, max_batch=2, max_len=64, prefill_chunk=8, bucket_shapes=bucket)
    engine.add(0, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()  # a step is in flight now
    assert engine.cache.nbytes > 0 and engine.num_active == 1
    engine.close()
    assert engine.cache.nbytes == 0 and engine.num_active == 0
    for use in (lambda: engine.add(1, [1, 2], SamplingParams(max_new_tokens=2)), engine.step, engine.warm_up):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    engine.close()  # idempotent
    assert engine.kv_stats() is None or engine.kv_stats().blocks_total > 0  # counters stay readable


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
