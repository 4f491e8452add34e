"""End to end: the tiny seeded Qwen3 text-generation serving behind a ServingPool."""

from __future__ import annotations

import functools

import pytest

from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models.text_generation import from_mlx4bit
from mlx_serving.serving import ServingPool


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny", "tiny", seed=0)
    return functools.partial(from_mlx4bit, path, max_new_tokens=6)


def test_pool_generates_what_a_local_serving_generates(factory):
    prompts = ["The pool says", "Hello"]
    expected = [factory().run(p)["results"][0] for p in prompts]
    with ServingPool(factory, workers=1) as pool:
        results = [pool.run(p)["results"][0] for p in prompts]
        streamed = list(pool.stream(prompts[0]))
    for got, want in zip(results, expected):
        assert got["generated_text"] == want["generated_text"]
        assert got["num_tokens"] == want["num_tokens"] == 6
    pieces = [item for item in streamed if isinstance(item, str)]
    assert "".join(pieces) == expected[0]["generated_text"]
    assert streamed[-1]["finish_reason"] == "length"
