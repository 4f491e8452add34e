"""Models loaded on demand (``Lazy``, ``keep_alive``, ``max_loaded_models``), as Ollama and
llama-server's router serve them: a real uvicorn server, tiny checkpoints loaded by the factories
for real, the official openai client. No wall-clock assertion: unloads are polled with a generous
cap, and the one bounded wait (``load_wait``) is on a load that cannot end before the test lets it."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlx_serving import Serving, ServingHandle, ServingStopped, text_generation
from mlx_serving.server import Lazy, ServedModel, create_app
from mlx_serving.server._keep_alive import NEVER, parse_keep_alive

from server_helpers import OPTIONS, metric_samples, serve, wait_for
from test_serve_cli import serve_process

MESSAGES = [{"role": "user", "content": "hi"}]
HTTP_S = 120.0  # httpx's own 5 s read timeout failed a request that reloads a model on a busy machine; a cap that only ends a hang


class Factory:
    """A ``Lazy`` loader of the tiny checkpoint: each call builds and starts a new serving
    (``built``: every handle it returned, in order); ``gate``, when given, holds each load until set."""

    def __init__(self, ckpt: Path, gate: threading.Event | None = None) -> None:
        self.ckpt, self.gate, self.built = ckpt, gate, []

    def __call__(self) -> ServedModel:
        if self.gate is not None:
            assert self.gate.wait(60), "the test never released the load"
        handle = Serving.start(text_generation.from_mlx4bit(self.ckpt, **OPTIONS))
        self.built.append(handle)
        return ServedModel(handle, OPTIONS["max_len"])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _statuses(url: str) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(f"{url}/v1/models", timeout=HTTP_S).json()["data"]}


def _chat(url: str, model: str, **extra: object) -> str:
    reply = _client(url).chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=extra)
    return reply.model


def _count(url: str, name: str, model: str, **labels: str) -> float:
    key = (f"mlx_serving:{name}", tuple(sorted({"model_name": model, **labels}.items())))
    return metric_samples(url).get(key, 0.0)


def _closed(handle: ServingHandle) -> bool:
    try:
        handle.run("x")
    except ServingStopped:
        return True
    return False


def test_a_model_loads_at_its_first_request(tiny_ckpt: Path):
    a, b = Factory(tiny_ckpt), Factory(tiny_ckpt)
    with serve(create_app({"a": Lazy(a), "b": Lazy(b)})) as url:
        assert _statuses(url) == {"a": "unloaded", "b": "unloaded"}
        assert httpx.get(f"{url}/health", timeout=HTTP_S).status_code == 200  # servable: each model loads when asked for
        unloaded = httpx.get(f"{url}/v1/models/a", timeout=HTTP_S).json()
        assert {k: v for k, v in unloaded.items() if k != "created"} == {
            "id": "a", "object": "model", "owned_by": "mlx-serving", "status": "unloaded"}  # task: not known yet
        assert _chat(url, "a") == "a"
        assert _statuses(url) == {"a": "loaded", "b": "unloaded"}
        loaded = httpx.get(f"{url}/v1/models/a", timeout=HTTP_S).json()
        assert loaded["task"] == "generate" and loaded["max_model_len"] == OPTIONS["max_len"]
        assert len(a.built) == 1 and not b.built
        assert _count(url, "model_loaded", "a") == 1 and _count(url, "model_loaded", "b") == 0
        assert _count(url, "model_loads_total", "a", outcome="ok") == 1
        assert _chat(url, "a") == "a" and len(a.built) == 1  # loaded once
    assert _closed(a.built[0])  # the app closed what it loaded


def test_a_cap_of_one_evicts_the_idle_least_recently_used_model(tiny_ckpt: Path):
    a, b = Factory(tiny_ckpt), Factory(tiny_ckpt)
    with serve(create_app({"a": Lazy(a), "b": Lazy(b)}, max_loaded_models=1)) as url:
        assert _chat(url, "a") == "a"
        assert _chat(url, "b") == "b"
        assert _statuses(url) == {"a": "unloaded", "b": "loaded"}
        assert _closed(a.built[0])
        assert _chat(url, "a") == "a"  # loaded again
        assert _statuses(url) == {"a": "loaded", "b": "unloaded"}
        assert len(a.built) == 2 and len(b.built) == 1
        assert _count(url, "model_unloads_total", "a", reason="evicted") == 1
        assert _count(url, "model_unloads_total", "b", reason="evicted") == 1
        assert _count(url, "model_loads_total", "a", outcome="ok") == 2


def test_keep_alive_zero_unloads_after_the_request(tiny_ckpt: Path):
    a = Factory(tiny_ckpt)
    with serve(create_app({"a": Lazy(a)})) as url:
        assert _chat(url, "a", keep_alive="5m") == "a"
        assert _statuses(url) == {"a": "loaded"}  # five minutes to go
        assert _chat(url, "a", keep_alive=0) == "a"
        wait_for(lambda: _statuses(url) == {"a": "unloaded"}, what="the model to unload")
        assert _closed(a.built[0])
        assert _count(url, "model_unloads_total", "a", reason="keep_alive") == 1
        # the other routes take the field too
        response = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1,
                                                               "keep_alive": -1}, timeout=HTTP_S)
        assert response.status_code == 200
        assert _client(url).responses.create(model="a", input="hi", max_output_tokens=1,
                                             extra_body={"keep_alive": "1h"}).model == "a"


def test_the_server_keep_alive_unloads_idle_models(tiny_ckpt: Path):
    a = Factory(tiny_ckpt)
    with serve(create_app({"a": Lazy(a)}, keep_alive=0.05)) as url:
        assert _chat(url, "a") == "a"
        wait_for(lambda: _statuses(url) == {"a": "unloaded"}, what="the idle model to unload")
        assert _chat(url, "a") == "a" and len(a.built) == 2


def test_a_bad_keep_alive_is_a_400_naming_it(tiny_ckpt: Path):
    with serve(create_app({"a": Lazy(Factory(tiny_ckpt))})) as url:
        with pytest.raises(openai.BadRequestError) as err:
            _chat(url, "a", keep_alive="5 minutes")
        assert err.value.body["param"] == "keep_alive" and "5 minutes" in err.value.body["message"]
        assert _statuses(url) == {"a": "unloaded"}  # nothing loaded for a refused request


def test_a_model_is_not_unloaded_while_a_stream_is_open(tiny_ckpt: Path):
    """Under a cap of 1, a request for b must wait for a's open stream (kept 0 s once idle) to end:
    a's stream runs to its end, uncut, and b is answered after it."""
    a, b = Factory(tiny_ckpt), Factory(tiny_ckpt)
    with serve(create_app({"a": Lazy(a), "b": Lazy(b)}, max_loaded_models=1)) as url:
        stream = _client(url).completions.create(model="a", prompt="a long story", max_tokens=300, stream=True,
                                                 extra_body={"ignore_eos": True, "keep_alive": 0})
        chunks = [next(stream) for _ in range(3)]
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(_chat, url, "b")
            chunks += list(stream)
            assert other.result(60) == "b"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert a.built[0].stats().completed == 1  # the row ended (not cancelled, not failed)
        assert _statuses(url) == {"a": "unloaded", "b": "loaded"}


def test_concurrent_first_requests_trigger_one_load(tiny_ckpt: Path):
    gate = threading.Event()
    a = Factory(tiny_ckpt, gate)
    with serve(create_app({"a": Lazy(a)})) as url:
        with ThreadPoolExecutor(8) as pool:
            replies = [pool.submit(_chat, url, "a") for _ in range(8)]
            wait_for(lambda: _statuses(url) == {"a": "loading"}, what="the load to start")
            gate.set()
            assert [r.result(60) for r in replies] == ["a"] * 8
        assert len(a.built) == 1
        assert _count(url, "model_loads_total", "a", outcome="ok") == 1


def test_a_request_waits_for_a_load_at_most_load_wait(tiny_ckpt: Path):
    gate = threading.Event()
    a = Factory(tiny_ckpt, gate)
    with serve(create_app({"a": Lazy(a)}, load_wait=0.2)) as url:
        refused = httpx.post(f"{url}/v1/chat/completions", json={"model": "a", "messages": MESSAGES}, timeout=HTTP_S)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "model_loading" and "'a'" in refused.json()["error"]["message"]
        gate.set()
        wait_for(lambda: _statuses(url) == {"a": "loaded"}, what="the load to end")
        assert _chat(url, "a") == "a" and len(a.built) == 1


def test_a_failing_load_names_the_model_and_spares_the_others(tiny_ckpt: Path):
    def broken() -> ServedModel:
        raise FileNotFoundError("no checkpoint at /nowhere")

    with serve(create_app({"broken": Lazy(broken), "a": Lazy(Factory(tiny_ckpt))})) as url:
        with pytest.raises(openai.InternalServerError) as err:
            _chat(url, "broken")
        error = err.value.body
        assert error["code"] == "model_load_failed" and error["param"] == "model"
        assert "'broken'" in error["message"] and "no checkpoint at /nowhere" in error["message"]
        assert _statuses(url) == {"broken": "failed", "a": "unloaded"}
        assert _chat(url, "a") == "a"
        assert httpx.get(f"{url}/health", timeout=HTTP_S).status_code == 200
        assert _count(url, "model_loads_total", "broken", outcome="failed") == 1
        with pytest.raises(openai.InternalServerError):  # tried again at the next request
            _chat(url, "broken")
        assert _count(url, "model_loads_total", "broken", outcome="failed") == 2


def test_models_given_loaded_stay_loaded_beside_lazy_ones(tiny_ckpt: Path, tiny_serving: Serving):
    lazy = Factory(tiny_ckpt)
    with Serving.start(tiny_serving) as handle:
        with serve(create_app({"given": handle, "lazy": Lazy(lazy)}, max_loaded_models=2, keep_alive=0)) as url:
            assert _statuses(url) == {"given": "loaded", "lazy": "unloaded"}
            assert _chat(url, "lazy") == "lazy" and _chat(url, "given", keep_alive=0) == "given"
            wait_for(lambda: _statuses(url) == {"given": "loaded", "lazy": "unloaded"}, what="lazy to unload")
        assert not _closed(handle)  # the caller's to close


def test_serve_with_a_cap_below_the_models_loads_them_on_demand(tiny_ckpt: Path):
    with serve_process(tiny_ckpt, "--model", str(tiny_ckpt), "--served-model-name", "a", "--served-model-name", "b",
                       "--max-loaded-models", "1", "--max-len", "320", "--log-level", "warning") as (url, _):
        assert _statuses(url) == {"a": "unloaded", "b": "unloaded"}
        assert _chat(url, "a") == "a"
        assert _statuses(url) == {"a": "loaded", "b": "unloaded"}
        assert _chat(url, "b", keep_alive=0) == "b"
        wait_for(lambda: _statuses(url) == {"a": "unloaded", "b": "unloaded"}, what="b to unload")


def test_serve_refuses_a_bad_keep_alive():
    done = subprocess.run([sys.executable, "-m", "mlx_serving", "serve", "--keep-alive", "5 minutes"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--keep-alive must be seconds" in done.stderr


@pytest.mark.parametrize(("value", "seconds"), [
    (0, 0.0), (30, 30.0), (2.5, 2.5), ("90", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3),
    ("-1", NEVER), (-1, NEVER), ("-5m", NEVER), ("never", NEVER), (" 10s ", 10.0)])
def test_keep_alive_values(value: object, seconds: float):
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [True, None, "5 minutes", "nan", "m5", "", "5d", [1]])
def test_bad_keep_alive_values(value: object):
    with pytest.raises(ValueError, match="keep_alive must be"):
        parse_keep_alive(value)
