"""The text-embedding serving against a reference computed independently: mlx-lm's Qwen3 (or
Llama) hidden states (``model.model(ids)``: final-normed, before the head) on seeded checkpoints,
token ids from the ``tokenizers`` library with the checkpoint's own post-processor, and the
pooling written here in numpy (float32). Batched == solo and padding never changes a vector."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import tokenizers

from mlx_serving import InvalidInput, Serving, text_embedding
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models.text_embedding import write_embedding_checkpoint
from mlx_serving.models.text_embedding.seeded import QUERY_PROMPT

TEXTS = ["hello world", "a much longer text about nothing in particular " * 3, "hi",
         "the quick brown fox jumps over the lazy dog", "Ünïcödé and emoji 🎉 too"]
MAX_LEN = 64


@pytest.fixture(scope="module")
def emb_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-Embedding's layout on the tiny seeded Qwen3, dense float32 (exact parity)."""
    return write_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "qwen3-emb", quantized=False, dtype="float32")


@pytest.fixture(scope="module")
def emb(emb_ckpt: Path) -> Iterator[Serving]:
    serving = text_embedding.from_mlx4bit(emb_ckpt, max_len=MAX_LEN, batch_size=8)
    yield serving
    serving.close()


@pytest.fixture(scope="module")
def reference(emb_ckpt: Path):
    """``ids -> final hidden states (T, D)`` from mlx-lm, and the checkpoint's tokenizer (HF
    ``tokenizers``, its post-processor appending ``<|endoftext|>``)."""
    model, _ = mlx_lm.load(str(emb_ckpt))
    tok = tokenizers.Tokenizer.from_file(str(emb_ckpt / "tokenizer.json"))
    return (lambda ids: np.array(model.model(mx.array([ids])), dtype=np.float32)[0]), tok


def _l2(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_config_is_read_from_the_sentence_transformers_files(emb_ckpt: Path, tiny_ckpt: Path):
    config = text_embedding.read_embedding_config(emb_ckpt)
    assert (config.pooling, config.normalize, config.suffix) == ("last", True, (151643,))
    assert config.prompts["query"] == QUERY_PROMPT
    assert text_embedding.is_embedding_model(emb_ckpt) and not text_embedding.is_embedding_model(tiny_ckpt)


def test_last_token_pooling_equals_the_reference(emb: Serving, reference):
    hidden, tok = reference
    for text in TEXTS:
        out = emb.run(text)
        ids = tok.encode(text).ids  # add_special_tokens: <|endoftext|> appended
        assert out["num_tokens"] == len(ids) and out["embedding"].dtype == np.float32
        np.testing.assert_allclose(out["embedding"], _l2(hidden(ids)[-1]), rtol=0, atol=1e-6)


def test_batched_equals_solo_and_padding_changes_nothing(emb: Serving):
    solo = [emb.run(t)["embedding"] for t in TEXTS]
    together = emb.run(TEXTS)  # one bucket: every row padded to the longest one's
    reversed_ = emb.run([{"text": t} for t in TEXTS[::-1]])  # other neighbours, other row order
    for a, b, c in zip(solo, together, reversed_[::-1]):
        np.testing.assert_array_equal(a, b["embedding"])
        np.testing.assert_array_equal(a, c["embedding"])


def test_started_serving_batches_by_bucket(emb: Serving):
    solo = {t: emb.run(t)["embedding"] for t in TEXTS}
    events = []
    results: dict[int, np.ndarray] = {}
    with Serving.start(emb.telemetry(events.append), batch_timeout=0.05) as handle:
        def call(i: int) -> None:
            results[i] = handle.run(TEXTS[i % len(TEXTS)])["embedding"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = handle.stats()
    for i, v in results.items():
        np.testing.assert_array_equal(v, solo[TEXTS[i % len(TEXTS)]])
    executed = [e for e in events if e.kind == "execute"]
    assert stats.completed == 20 and {e.batch_key for e in executed} <= {16, 32, 64}
    assert sum(e.rows for e in executed) == 20 and len(executed) < 20  # rows merged across callers


def test_mean_pooling_for_a_plain_decoder(tmp_path: Path):
    ckpt = write_checkpoint(tmp_path / "llama", "tiny", seed=1, family="llama", quantized=False, dtype="float32")
    model, _ = mlx_lm.load(str(ckpt))
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    with text_embedding.from_mlx4bit(ckpt, max_len=MAX_LEN) as serving:
        outs = serving.run(TEXTS[:3])
    for text, out in zip(TEXTS[:3], outs):
        ids = tok.encode(text).ids  # the plain Qwen3 tokenizer adds no special tokens
        h = np.array(model.model(mx.array([ids])), dtype=np.float32)[0]
        np.testing.assert_allclose(out["embedding"], _l2(h.mean(axis=0)), rtol=0, atol=1e-6)


def test_quantized_checkpoint_matches_mlx_lm_in_float32(tmp_path: Path):
    ckpt = write_embedding_checkpoint(tmp_path / "q4")  # mlx-community 4-bit layout
    model, _ = mlx_lm.load(str(ckpt))
    model.set_dtype(mx.float32)
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    # the exact float path (the default "native" products: test_text_embedding_native.py)
    with text_embedding.from_mlx4bit(ckpt, max_len=MAX_LEN, products="matmul") as serving:
        for text in TEXTS[:2]:
            ids = tok.encode(text).ids
            h = np.array(model.model(mx.array([ids])), dtype=np.float32)[0]
            np.testing.assert_allclose(serving.run(text)["embedding"], _l2(h[-1]), rtol=0, atol=1e-5)


def test_dimensions_instruction_prompt_name_and_token_ids(emb: Serving, reference):
    hidden, tok = reference
    text = TEXTS[3]
    full = hidden(tok.encode(text).ids)[-1]
    out = emb.run({"text": text, "dimensions": 16})
    np.testing.assert_allclose(out["embedding"], _l2(full[:16]), rtol=0, atol=1e-6)  # truncate, then normalize
    query = tok.encode("Instruct: find animals\nQuery:" + text).ids
    np.testing.assert_allclose(emb.run({"text": text, "instruction": "find animals"})["embedding"],
                               _l2(hidden(query)[-1]), rtol=0, atol=1e-6)
    named = tok.encode(QUERY_PROMPT + text).ids
    np.testing.assert_allclose(emb.run({"text": text, "prompt_name": "query"})["embedding"],
                               _l2(hidden(named)[-1]), rtol=0, atol=1e-6)
    ids = [9707, 1879, 11, 279]  # used as given: nothing appended
    out = emb.run({"input_ids": ids})
    assert out["num_tokens"] == 4
    np.testing.assert_allclose(out["embedding"], _l2(hidden(ids)[-1]), rtol=0, atol=1e-6)


def test_long_inputs_are_refused_or_truncated_as_asked(emb: Serving, reference):
    hidden, tok = reference
    long = "word " * 200
    with pytest.raises(InvalidInput) as info:
        emb.run(long)
    assert info.value.param == "text" and "max_len" in str(info.value)
    out = emb.run({"text": long, "truncate": True})
    ids = tok.encode(long).ids[: MAX_LEN - 1] + [151643]  # the text cut, <|endoftext|> kept
    assert out["num_tokens"] == MAX_LEN
    np.testing.assert_allclose(out["embedding"], _l2(hidden(ids)[-1]), rtol=0, atol=1e-6)
    with pytest.raises(InvalidInput) as info:
        emb.run({"input_ids": [1] * (MAX_LEN + 1)})
    assert info.value.param == "input_ids"


@pytest.mark.parametrize(("bad", "param"), [
    ([], None), (3, None), ({"text": ""}, "text"), ({"text": "x", "colour": 1}, "colour"),
    ({"text": "x", "dimensions": 0}, "dimensions"), ({"text": "x", "dimensions": 65}, "dimensions"),
    ({"text": "x", "dimensions": True}, "dimensions"), ({"text": "x", "truncate": "yes"}, "truncate"),
    ({"text": "x", "prompt_name": "nope"}, "prompt_name"), ({"text": "x", "instruction": 3}, "instruction"),
    ({"input_ids": [10**9]}, "input_ids"), ({"input_ids": [1], "instruction": "q"}, "input_ids"),
    (["ok", {"text": "x", "dimensions": -1}], "dimensions"),
])
def test_bad_input_names_the_key(emb: Serving, bad: object, param: str | None):
    with pytest.raises(InvalidInput) as info:
        emb.run(bad)
    assert info.value.param == param


def test_a_bad_request_never_fails_its_batchmates(emb: Serving):
    with Serving.start(emb, batch_timeout=0.05) as handle:
        good = handle.stream(TEXTS[0])  # submitted, waiting for its batch
        with pytest.raises(InvalidInput):
            handle.run({"text": TEXTS[1], "dimensions": 10_000})
        with good:
            (vectors, _meta), = list(good)
    assert vectors.shape == (1, 64)


def test_options_are_checked(emb_ckpt: Path):
    with pytest.raises(TypeError, match="unknown text-embedding options"):
        text_embedding.from_mlx4bit(emb_ckpt, max_new_tokens=3)
    with pytest.raises(ValueError, match="pooling"):
        text_embedding.from_mlx4bit(emb_ckpt, pooling="max")
    with pytest.raises(ValueError, match="last bucket"):
        text_embedding.from_mlx4bit(emb_ckpt, max_len=64, buckets=(16, 32))


def test_unsupported_pooling_in_the_checkpoint_is_refused(emb_ckpt: Path, tmp_path: Path):
    import json
    import shutil

    ckpt = Path(shutil.copytree(emb_ckpt, tmp_path / "maxpool"))
    pool = json.loads((ckpt / "1_Pooling" / "config.json").read_text())
    pool.update(pooling_mode_lasttoken=False, pooling_mode_max_tokens=True)
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    with pytest.raises(ValueError, match="pooling_mode"):
        text_embedding.read_embedding_config(ckpt)


@pytest.mark.parametrize(("pooling_type", "pooling"), [(3, "last"), (None, "mean")])
def test_a_gguf_file_loads_with_the_pooling_it_declares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        pooling_type: int | None, pooling: str):
    from gguf import GGMLQuantizationType
    from gguf_files import Shape, write_gguf

    from mlx_serving.models._fetch import cache_dir
    from mlx_serving.models.sources import resolve

    cache = tmp_path / "cache"  # the conversion's, dropped after the test; the built CPU kernels shared
    cache.mkdir()
    native = cache_dir() / "native"
    native.mkdir(parents=True, exist_ok=True)
    (cache / "native").symlink_to(native, target_is_directory=True)
    monkeypatch.setenv("MLX_SERVING_CACHE", str(cache))
    meta = {} if pooling_type is None else {"qwen3.pooling_type": pooling_type}  # llama.cpp's key
    gguf = tmp_path / "emb.gguf"
    write_gguf(gguf, Shape(arch="qwen3"), GGMLQuantizationType.F32, extra_metadata=meta)
    assert text_embedding.gguf_pooling(gguf) == (None if pooling_type is None else pooling)
    converted = resolve(gguf).path
    model, _ = mlx_lm.load(str(converted))
    tok = tokenizers.Tokenizer.from_file(str(converted / "tokenizer.json"))
    with text_embedding.from_pretrained(gguf, max_len=MAX_LEN) as serving:
        out = serving.run("hello world")
    h = np.array(model.model(mx.array([tok.encode("hello world").ids])), dtype=np.float32)[0]
    np.testing.assert_allclose(out["embedding"], _l2(h[-1] if pooling == "last" else h.mean(axis=0)), rtol=0, atol=1e-6)
