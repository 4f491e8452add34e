"""The embedding serving's "native" products (the default on the CPU): a batch's texts packed into
one sequence, the quantized products on the text-generation prefill's int8 GEMM. Its vectors agree
with the exact float path ("matmul") on real text with the real default model (SmolLM2-135M, 4-bit),
and a text's vector never depends on its batchmates, bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mlx_serving import Serving, text_embedding
from mlx_serving.models.loader import load
from mlx_serving.models.text_embedding import write_embedding_checkpoint
from mlx_serving.tokenization import Tokenizer

#: Real sentences of mixed lengths and topics (the fidelity set of docs/embeddings.md).
REAL_TEXTS = [
    "The capital of France is Paris.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "How do I reset my password if I no longer have access to my email account?",
    "The Treaty of Westphalia in 1648 ended the Thirty Years' War and reshaped the political map of Europe.",
    "Add two cups of flour, a pinch of salt and mix until the dough is smooth.",
    "Neural networks learn representations by adjusting weights to minimize a loss function over training data.",
    "It rained all afternoon, so we stayed inside and played chess by the window.",
    "The stock market fell sharply on Monday after the central bank raised interest rates.",
    "def add(a, b):\n    return a + b",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level.",
    "Please find attached the quarterly report; let me know if you have any questions before Friday's meeting.",
    "Water boils at 100 degrees Celsius at sea level, but at a lower temperature at high altitude.",
]


def _cosines(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    x, y = np.stack(a), np.stack(b)
    return (x * y).sum(axis=1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_native_vectors_agree_with_the_exact_path_on_real_text(smollm2_dir: Path, pooling: str):
    state, tok = load(smollm2_dir), Tokenizer.from_dir(smollm2_dir)
    runs = {}
    for products in ("native", "matmul"):
        with text_embedding.serving(tok, state, max_len=128, pooling=pooling, products=products) as serving:
            runs[products] = [out["embedding"] for out in serving.run(REAL_TEXTS)]
    cos = _cosines(runs["native"], runs["matmul"])
    assert cos.min() > 0.999, cos
    assert any(not np.array_equal(a, b) for a, b in zip(runs["native"], runs["matmul"]))  # int8 products ran


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The tiny seeded Qwen3-Embedding, 4-bit: the default products are the native ones."""
    ckpt = write_embedding_checkpoint(tmp_path_factory.mktemp("q4") / "emb")
    serving = text_embedding.from_mlx4bit(ckpt, max_len=64, batch_size=8)
    yield serving
    serving.close()


def test_a_vector_does_not_depend_on_its_batchmates(q4: Serving):
    texts = REAL_TEXTS[:6]
    solo = [q4.run(t)["embedding"] for t in texts]
    together = q4.run(texts)  # one packed forward
    reversed_ = q4.run(texts[::-1])  # other neighbours, other places in the sequence
    for a, b, c in zip(solo, together, reversed_[::-1]):
        np.testing.assert_array_equal(a, b["embedding"])
        np.testing.assert_array_equal(a, c["embedding"])
    results: dict[int, np.ndarray] = {}
    with Serving.start(q4, batch_timeout=0.05) as handle:  # batches of whichever callers came together
        def call(i: int) -> None:
            results[i] = handle.run(texts[i % len(texts)])["embedding"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(18)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert handle.stats().batches_run < 18
    for i, v in results.items():
        np.testing.assert_array_equal(v, solo[i % len(texts)])


def test_products_are_checked(tmp_path: Path):
    ckpt = write_embedding_checkpoint(tmp_path / "emb")
    with pytest.raises(ValueError, match="products must be one of"):
        text_embedding.from_mlx4bit(ckpt, products="int8")
    state, tok = load(ckpt, dtype="bfloat16"), Tokenizer.from_dir(ckpt)
    with pytest.raises(ValueError, match="products 'native' does not apply: it needs float32 activations"):
        text_embedding.serving(tok, state, products="native")
    with text_embedding.serving(tok, state) as default, \
            text_embedding.serving(tok, state, products="matmul") as exact:  # None: the exact path here
        np.testing.assert_array_equal(default.run("hello")["embedding"], exact.run("hello")["embedding"])
