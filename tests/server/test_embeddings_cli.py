"""``mlx-serving serve --model GEN --model EMB`` as a user runs it (a subprocess): a generation model
and an embedding model (one that ships sentence-transformers' ``modules.json`` +
``1_Pooling/config.json``) side by side, each under its ``--served-model-name``."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from mlx_serving import text_embedding
from mlx_serving.models.text_embedding import write_embedding_checkpoint
from test_serve_cli import serve_process


@pytest.fixture(scope="module")
def emb_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "qwen3-emb")


@pytest.fixture(scope="module")
def two_models(tiny_ckpt: Path, emb_ckpt: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    with serve_process(tiny_ckpt, "--model", str(emb_ckpt), "--served-model-name", "gen",
                       "--served-model-name", "emb", "--max-len", "320", "--max-batch", "4", "--max-new-tokens", "4",
                       "--embedding-max-len", "128", "--embedding-batch", "4", "--log-level", "warning") as served:
        yield served


def test_generation_and_embedding_side_by_side(two_models: tuple[str, subprocess.Popen], emb_ckpt: Path):
    url, _ = two_models
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert set(models) == {"gen", "emb"}
    assert (models["gen"]["task"], models["emb"]["task"], models["emb"]["max_model_len"]) == ("generate", "embed", 128)
    reply = client.chat.completions.create(model="gen", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens == 3
    vectors = client.embeddings.create(model="emb", input=["hello world", "hi"])
    with text_embedding.from_mlx4bit(emb_ckpt, max_len=128) as serving:
        expected = serving.run(["hello world", "hi"])
    for got, want in zip(vectors.data, expected):
        np.testing.assert_allclose(np.array(got.embedding, np.float32), want["embedding"], rtol=0, atol=1e-6)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="gen", input="hi")
