"""``POST /v1/embeddings`` on a real uvicorn server next to a generation model, driven by the
official ``openai`` client (and LangChain's ``OpenAIEmbeddings`` and litellm's ``embedding`` when
they are installed): outputs equal ``Serving.run``, float and base64, ``dimensions``, token-id
inputs, usage, errors naming ``param``, routes refusing the other task, metrics."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from mlx_serving import Serving, text_embedding
from mlx_serving.models.text_embedding import write_embedding_checkpoint
from mlx_serving.server import ServedModel, create_app
from server_helpers import MODEL, metric_samples, serve

EMB = "emb"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "hi", "a longer text " * 12]


@pytest.fixture(scope="module")
def emb_serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    ckpt = write_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "e", quantized=False, dtype="float32")
    serving = text_embedding.from_mlx4bit(ckpt, max_len=64, batch_size=8)
    yield serving
    serving.close()


@pytest.fixture(scope="module")
def url(tiny_serving: Serving, emb_serving: Serving) -> Iterator[str]:
    with Serving.start(tiny_serving, max_queue=64) as gen, Serving.start(emb_serving, max_queue=64) as emb:
        app = create_app({MODEL: gen, EMB: ServedModel(emb, 64, None, task="embed")})
        with serve(app) as base:
            yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _expected(serving: Serving, item: object) -> np.ndarray:
    return serving.run(item)["embedding"]


def test_default_base64_equals_serving_run(client: openai.OpenAI, emb_serving: Serving):
    reply = client.embeddings.create(model=EMB, input=TEXTS[0])  # the client asks for base64
    assert reply.object == "list" and reply.model == EMB and len(reply.data) == 1
    np.testing.assert_array_equal(np.array(reply.data[0].embedding, np.float32), _expected(emb_serving, TEXTS[0]))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == emb_serving.run(TEXTS[0])["num_tokens"]


def test_float_format_several_inputs_and_dimensions(client: openai.OpenAI, emb_serving: Serving):
    reply = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float", dimensions=16)
    assert [d.index for d in reply.data] == [0, 1, 2, 3]
    for text, d in zip(TEXTS, reply.data):
        assert len(d.embedding) == 16
        np.testing.assert_array_equal(np.array(d.embedding, np.float32),
                                      _expected(emb_serving, {"text": text, "dimensions": 16}))
    assert reply.usage.prompt_tokens == sum(r["num_tokens"] for r in emb_serving.run(TEXTS))


def test_raw_base64_is_little_endian_float32(url: str, emb_serving: Serving):
    body = httpx.post(f"{url}/v1/embeddings", json={"model": EMB, "input": "hi", "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vector, _expected(emb_serving, "hi"))


def test_token_id_inputs_and_extension_fields(client: openai.OpenAI, emb_serving: Serving):
    ids = [[9707, 1879], [279, 3974, 13876]]
    reply = client.embeddings.create(model=EMB, input=ids)
    for one, d in zip(ids, reply.data):
        np.testing.assert_array_equal(np.array(d.embedding, np.float32), _expected(emb_serving, {"input_ids": one}))
    assert reply.usage.prompt_tokens == 5
    single = client.embeddings.create(model=EMB, input=ids[0])
    np.testing.assert_array_equal(single.data[0].embedding, reply.data[0].embedding)
    query = client.embeddings.create(model=EMB, input="fox", extra_body={"instruction": "find animals"})
    np.testing.assert_array_equal(np.array(query.data[0].embedding, np.float32),
                                  _expected(emb_serving, {"text": "fox", "instruction": "find animals"}))
    cut = client.embeddings.create(model=EMB, input="word " * 100, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 64


def test_concurrent_requests_are_batched_and_equal_solo(url: str, emb_serving: Serving):
    async def main() -> list[list[float]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.embeddings.create(model=EMB, input=TEXTS[i % 4])
                                             for i in range(16)))
        return [r.data[0].embedding for r in replies]

    for i, vector in enumerate(asyncio.run(main())):
        np.testing.assert_array_equal(np.array(vector, np.float32), _expected(emb_serving, TEXTS[i % 4]))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"), ({"input": [1, "a"]}, "input"), ({"input": 3}, "input"), ({"input": ""}, "input"),
    ({"input": "word " * 100}, "input"), ({"input": [[1], [10**9]]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": 10_000}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "colour": 1}, "colour"),
    ({"input": "x", "prompt_name": "nope"}, "prompt_name"), ({"input": "x", "truncate": "yes"}, "truncate"),
    ({"input": ["x"] * 65}, "input"),  # more inputs than the serving queues at once (max_queue 64)
])
def test_bad_requests_are_400_naming_the_field(client: openai.OpenAI, body: dict, param: str):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=EMB, **{k: v for k, v in body.items() if k == "input"},
                                 extra_body={k: v for k, v in body.items() if k != "input"})
    assert info.value.body["param"] == param, info.value.body


def test_each_route_refuses_the_other_task(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert info.value.body["param"] == "model" and info.value.body["code"] == "wrong_model_task"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=EMB, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    tasks = {m.id: m.model_extra["task"] for m in client.models.list().data}
    assert tasks == {MODEL: "generate", EMB: "embed"}


def test_a_request_without_model_gets_the_first_embedding_model(url: str):
    body = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}).json()
    assert body["model"] == EMB and len(body["data"]) == 1


def test_metrics_count_embedded_inputs_and_tokens(client: openai.OpenAI, url: str):
    def value(name: str) -> float:
        return metric_samples(url).get((name, (("model_name", EMB),)), 0.0)

    inputs, tokens = value("mlx_serving:embedding_inputs_total"), value("mlx_serving:prompt_tokens_total")
    reply = client.embeddings.create(model=EMB, input=TEXTS[:3])
    assert value("mlx_serving:embedding_inputs_total") == inputs + 3
    assert value("mlx_serving:prompt_tokens_total") == tokens + reply.usage.prompt_tokens


def test_langchain_openai_embeddings(url: str, emb_serving: Serving):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    # check_embedding_ctx_length=False: send the texts (by default LangChain sends tiktoken ids of
    # OpenAI's own vocabulary, which mean nothing to another model, and fetches tiktoken's files)
    embeddings = langchain_openai.OpenAIEmbeddings(model=EMB, base_url=f"{url}/v1", api_key="unused",
                                                   check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(TEXTS[:2])
    for text, vector in zip(TEXTS[:2], documents):
        np.testing.assert_allclose(vector, _expected(emb_serving, text), rtol=0, atol=1e-7)
    np.testing.assert_allclose(embeddings.embed_query(TEXTS[2]), _expected(emb_serving, TEXTS[2]), rtol=0, atol=1e-7)


def test_litellm_embedding(url: str, emb_serving: Serving, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list (read at import)
    litellm = pytest.importorskip("litellm", reason="litellm is not installed")
    reply = litellm.embedding(model=f"openai/{EMB}", input=TEXTS[:2], api_base=f"{url}/v1", api_key="unused")
    for text, item in zip(TEXTS[:2], reply.data):
        np.testing.assert_allclose(item["embedding"], _expected(emb_serving, text), rtol=0, atol=1e-7)
    assert reply.usage.prompt_tokens == sum(r["num_tokens"] for r in emb_serving.run(TEXTS[:2]))
