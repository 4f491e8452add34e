"""Issue 37: no shape is built on a request's path. With shape bucketing (the GPU default, forced on
here on the CPU with the tiny model) a started text-generation serving has built every shape its
steps meet before ``Serving.start`` returns; a burst of requests of new lengths (first chunks,
later chunks, several rows at once, under a token budget) then adds no shape the runner had not
run (``cold_shapes``, counted in the runner per forward part: projections and each attention call).
"""

from __future__ import annotations

import threading

import numpy as np

from mlx_serving.models import text_generation
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams
from mlx_serving.models.decoder.layers import State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

OPTS = dict(max_new_tokens=6, max_len=192, max_batch=8, prefill_chunk=32, bucket_shapes=True, max_step_tokens=64,
            prefix_caching=False)


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "river", "stone", "cloud", "maple", "quiet", "ember", "north", "lumen", "orbit"]
    return [" ".join(rng.choice(words, int(rng.integers(1, 150)))) for _ in range(n)]


def test_a_started_serving_builds_no_shape_on_a_request_path(tiny32: State) -> None:
    gen = text_generation.serving(Tokenizer.qwen3(), tiny32, **OPTS)
    with Serving.start(gen) as handle:
        backend = handle.stats().backend
        assert backend["warm_shapes_left"] == 0 and backend["cold_shapes"] == 0
        results: list[dict] = []

        def ask(text: str) -> None:
            results.append(handle.run({"text": text, "temperature": 0.7, "seed": 1}))

        for wave in range(3):  # bursts of 10: several prefill rows per step, long prompts in chunks
            threads = [threading.Thread(target=ask, args=(t,)) for t in _texts(10, wave)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        backend = handle.stats().backend
    assert len(results) == 30 and all(r["results"][0]["num_tokens"] >= 1 for r in results)
    assert backend["cold_shapes"] == 0


def test_an_unwarmed_engine_counts_the_shapes_it_builds(tiny32: State) -> None:
    """The counter can fail: the same kind of traffic on an engine that skipped its warm-up counts
    every shape it meets as built on the path."""
    engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=192, prefill_chunk=32, bucket_shapes=True,
                                            max_step_tokens=64))
    tok = Tokenizer.qwen3()
    for i, text in enumerate(_texts(4, 7)):
        engine.add(i, tok.encode(text), SamplingParams(max_new_tokens=4))
    while engine.num_active:
        engine.step()
    assert engine.runner.cold_shapes > 0
    engine.close()


def test_prefix_hits_start_on_warmed_shapes(tiny32: State) -> None:
    """With bucketing a cached prefix is reused in whole prefill chunks: prompts sharing a 70-token
    system part (chunks of 32) reuse 64 of its tokens, build no shape on the path, and give the
    tokens they give without prefix caching."""
    tok = Tokenizer.qwen3()
    system = tok.encode(" ".join(["alpha river stone cloud maple quiet ember north lumen orbit"] * 8))[:70]
    prompts = [system + tok.encode(t) for t in _texts(6, 11)]
    outputs = {}
    for caching in (True, False):
        engine = Engine(tiny32, EngineConfig.of(max_batch=4, max_len=256, prefill_chunk=32, bucket_shapes=True,
                                                max_step_tokens=64, prefix_caching=caching))
        engine.warm_up()
        out: dict[int, list[int]] = {}
        for wave in (prompts[:1], prompts[1:]):  # the first one caches the system part
            for i, p in enumerate(wave, start=len(out)):
                engine.add(i, p, SamplingParams(max_new_tokens=4))
                out[i] = []
            while engine.num_active:
                for ev in engine.step():
                    out[ev.seq_id].append(ev.token_id)
        stats = engine.kv_stats()
        if caching:
            assert stats.prefix_hit_tokens > 0 and stats.prefix_hit_tokens % 32 == 0
        assert engine.runner.cold_shapes == 0
        outputs[caching] = out
        engine.close()
    assert outputs[True] == outputs[False]
