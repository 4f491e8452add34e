"""``mlx-serving serve`` as a user runs it: a subprocess with ``--workers 2`` (the app over a
``ServingPool``), the API key from the environment, /health until ready, a disconnect cancelling
the row inside a worker, Ctrl-C ending it (status 130, as every mlx-serving command)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_serving.server._cli import API_KEY_ENV, _embedding_options, _generation_options, _model_specs

from server_helpers import wait_for

KEY = "k-123"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_sigint() -> None:
    """In the child: Ctrl-C's default action, also when the tests run as a background job (whose
    shell started them with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Until /health answers 200; the server's stderr in the failure when it exits first."""
    def healthy() -> bool:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        try:
            return httpx.get(f"{url}/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, timeout=timeout, what="the server to be healthy")


@contextmanager
def serve_process(ckpt: Path, *options: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``mlx-serving serve --model ckpt *options`` in a subprocess on a free port, until healthy:
    ``(base URL, process)``; killed on exit if still running."""
    port = _free_port()
    command = [sys.executable, "-m", "mlx_serving", "serve", "--model", str(ckpt), "--port", str(port), *options]
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, timeout=300)  # a cap that only ends a hang (2 shared cores)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.fixture(scope="module")
def cli_server(tiny_ckpt: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    with serve_process(tiny_ckpt, "--workers", "2", "--max-len", "320", "--max-batch", "8", "--max-new-tokens", "4", "--temperature", "0",
                       "--log-level", "warning", env={API_KEY_ENV: KEY}) as served:
        yield served


def _cancelled(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "mlx_serving:serving_requests_total" and s.labels["outcome"] == "cancelled")


def test_serve_over_a_pool(cli_server: tuple[str, subprocess.Popen]):
    url, _ = cli_server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    replies = {client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
               .choices[0].message.content for _ in range(4)}  # spread over both workers
    assert len(replies) == 1  # greedy: every worker answers the same
    reply = client.completions.create(model="tiny", prompt="abc")
    assert reply.usage.completion_tokens == 4  # --max-new-tokens is the default max_tokens

    body = {"prompt": "long", "max_tokens": 300, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=30) as response:
        data = (line for line in response.iter_lines() if line.startswith("data:"))
        [next(data) for _ in range(3)]
    wait_for(lambda: _cancelled(url) == 1, what="the worker to count the request cancelled")


def test_ctrl_c_stops_the_server(cli_server: tuple[str, subprocess.Popen]):
    url, process = cli_server
    process.send_signal(signal.SIGINT)
    assert process.wait(60) == 130  # the CLI's status for Ctrl-C, after a graceful shutdown
    stderr = process.stderr.read()
    assert "mlx-serving: interrupted" in stderr and "Traceback" not in stderr, stderr
    assert "ready: max_len 320, max_batch 8, KV cache " in stderr and " tokens (auto) per worker" in stderr, stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health")


def test_served_model_names(tmp_path: Path):
    from mlx_serving.cli import _parser

    (tmp_path / "a").mkdir()
    (tmp_path / "b.gguf").touch()
    args = _parser().parse_args(["serve", "--model", str(tmp_path / "a"), "--model", str(tmp_path / "b.gguf"),
                                 "--model", "org/name@v1"])
    assert [name for name, _ in _model_specs(args)] == ["a", "b", "org/name@v1"]  # dir, file stem, repo id
    args = _parser().parse_args(["serve", "--model", str(tmp_path / "a"), "--served-model-name", "qwen"])
    assert _model_specs(args) == [("qwen", str(tmp_path / "a"))]
    assert _model_specs(_parser().parse_args(["serve"])) == [("smollm2-135m-instruct", None)]  # the default
    for bad in (["--model", "x", "--model", "y", "--served-model-name", "one"],
                ["--model", "org/m", "--model", "org/m"], ["--workers", "0"]):
        with pytest.raises(ValueError):
            _model_specs(_parser().parse_args(["serve", *bad]))


def test_policy_option_reaches_the_serving_options():
    from mlx_serving.cli import _parser

    assert _generation_options(_parser().parse_args(["serve", "--policy", "priority"]))["policy"] == "priority"
    assert _generation_options(_parser().parse_args(["serve"]))["policy"] == "fcfs"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--policy", "lifo"])


def test_a_small_max_queue_needs_no_embedding_flag():
    """--embedding-batch's default follows a smaller --max-queue (serving no embedding model needs
    no embedding flag); a --embedding-batch given above --max-queue is refused."""
    from mlx_serving.cli import _parser

    args = _parser().parse_args(["serve", "--max-batch", "2", "--max-queue", "2"])
    assert _embedding_options(args)["batch_size"] == 2 and _generation_options(args)["max_batch"] == 2
    assert _embedding_options(_parser().parse_args(["serve"]))["batch_size"] == 32
    with pytest.raises(ValueError, match="--embedding-batch"):
        _embedding_options(_parser().parse_args(["serve", "--max-queue", "4", "--embedding-batch", "8"]))


@pytest.mark.timeout(600)  # a cap that only ends a hang: it took 110 s on 2 cores under load 20 (pytest's is 120 s)
def test_serve_with_no_model_serves_smollm2(private_cache, tmp_path: Path):
    """``mlx-serving serve`` alone: the default model, SmolLM2-135M-Instruct, under its name,
    answering an unmodified OpenAI client with real text (streamed and not)."""
    cache = private_cache(tmp_path / "cache")  # fetched once, converted anew here; the built kernels
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "mlx_serving", "serve", "--port", str(port), "--max-len", "256", "--max-new-tokens", "32", "--temperature", "0",
                                "--max-batch", "2", "--log-level", "warning"],
                               env={**os.environ, "MLX_SERVING_CACHE": str(cache)}, stderr=subprocess.PIPE, text=True,
                               preexec_fn=default_sigint)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, timeout=480)  # it converts the GGUF first
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]
        question = [{"role": "user", "content": "What is the capital of Japan?"}]
        reply = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, max_tokens=24)
        assert reply.choices[0].message.content == "The capital of Japan is Tokyo."
        assert reply.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, max_tokens=24,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            "The capital of Japan is Tokyo."
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130


# ---- a smaller context (issue 40 item 6) ---------------------------------------------------------

_P250, _P300 = "x" * 2000, "x" * 2400  # 250 and 300 tokens of "xxxxxxxx" (the Qwen3 tokenizer)


@pytest.fixture(scope="module")
def small_context(tiny_ckpt: Path) -> Iterator[openai.OpenAI]:
    """``serve --max-len 256`` and no --max-new-tokens (it refused to start: the default 256 left no room)."""
    with serve_process(tiny_ckpt, "--max-len", "256", "--log-level", "warning") as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_a_request_without_max_tokens_gets_the_default_capped_to_what_fits(small_context: openai.OpenAI):
    """The default (256, at most half of --max-len: 128) where it fits, else what the prompt leaves."""
    for prompt, tokens in (("hi", 128), (_P250, 6)):
        done = small_context.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
        assert (done.choices[0].finish_reason, done.usage.completion_tokens) == ("length", tokens), prompt
        assert done.usage.prompt_tokens + tokens <= 256


def test_an_over_long_request_names_the_field_to_lower_and_the_flag_to_raise(small_context: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as bad:
        small_context.completions.create(model="tiny", prompt=_P250, max_tokens=10)
    error = bad.value.body
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("prompt of 250 tokens + max_tokens 10 = 260 exceeds max_len 256: lower "
                                       "max_tokens to at most 6, or raise max_len (--max-len of mlx-serving serve")
    with pytest.raises(openai.BadRequestError) as bad:
        small_context.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 1600}],
                                              max_completion_tokens=100)  # 200 tokens and the template's
    chat_error = bad.value.body
    assert chat_error["param"] == "max_completion_tokens"
    assert "+ max_completion_tokens 100 = " in chat_error["message"]
    assert "lower max_completion_tokens to at most" in chat_error["message"]
    with pytest.raises(openai.BadRequestError) as bad:  # the prompt alone does not fit
        small_context.completions.create(model="tiny", prompt=_P300)
    prompt_error = bad.value.body
    assert prompt_error["param"] == "prompt" and "prompt of 300 tokens exceeds max_len 256" in prompt_error["message"]
    assert "truncate_prompt_tokens" in prompt_error["message"] and "--max-len" in prompt_error["message"]
    assert all("max_new_tokens" not in e["message"] for e in (error, chat_error, prompt_error))


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(small_context: openai.OpenAI):
    """vLLM's field: N keeps the last N tokens (of the rendered prompt for chat); -1 as many as fit
    with the new tokens (here the default 128)."""
    done = small_context.completions.create(model="tiny", prompt=_P300, max_tokens=2,
                                            extra_body={"truncate_prompt_tokens": 20})
    assert done.usage.prompt_tokens == 20
    done = small_context.completions.create(model="tiny", prompt=_P300, extra_body={"truncate_prompt_tokens": -1})
    assert done.usage.prompt_tokens == 128
    chat = small_context.chat.completions.create(model="tiny", messages=[{"role": "user", "content": _P300}],
                                                 max_tokens=2, extra_body={"truncate_prompt_tokens": 30})
    assert chat.usage.prompt_tokens == 30
    with pytest.raises(openai.BadRequestError) as bad:
        small_context.completions.create(model="tiny", prompt="hi", extra_body={"truncate_prompt_tokens": 0})
    assert bad.value.body["param"] == "truncate_prompt_tokens"
