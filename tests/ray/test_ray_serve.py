"""ServingDeployment and the OpenAI ingress (OpenAIDeployment): a started Serving per Ray Serve
replica (real Serve on the local cluster, its HTTP proxy on a free 127.0.0.1 port)."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from mlx_serving.serving import DeadlineExceeded  # noqa: E402
from mlx_serving.serving.ray import ServingDeployment, serving_app  # noqa: E402
from ray_helpers import wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a cap that only ends a hang

POOL_TESTS = str(Path(__file__).resolve().parent.parent / "pool")
# replicas import pool_servings through the runtime_env, as a cluster deployment ships its code
LIGHT = {"num_cpus": 0, "runtime_env": {"env_vars": {"PYTHONPATH": POOL_TESTS}}}
# serve.delete waits for each replica's graceful shutdown, which polls for in-flight requests every
# graceful_shutdown_wait_loop_s (2 s by default, slept once even when none is left); nothing is in
# flight when these tests delete their apps, so a short poll only shortens the wait
QUICK_DELETE = {"graceful_shutdown_wait_loop_s": 0.1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_instance(ray_cluster):
    """Serve with its HTTP proxy on loopback only; yields the proxy's base URL."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def test_run_stream_stats_and_batching(serve_instance):
    app = serving_app("pool_servings:sleeper", process_options={"batch_size": 4, "batch_timeout": 0.05},
                      ray_actor_options=LIGHT, name="sleeper", **QUICK_DELETE)
    handle = serve.run(app, name="sleeper", route_prefix=None)
    responses = [handle.run.remote((0.2, i, None)) for i in range(8)]
    assert [r.result(timeout_s=60)["tag"] for r in responses] == list(range(8))
    stats = handle.stats.remote().result()
    assert stats.completed == 8 and stats.batches_run < 8  # batched inside the replica's serving
    with pytest.raises(DeadlineExceeded):
        handle.run.remote((1.0, "late", None), deadline=0.2).result(timeout_s=30)
    serve.delete("sleeper")

    counter = serve.run(ServingDeployment.options(ray_actor_options=LIGHT, name="counter", **QUICK_DELETE).bind(
        "pool_servings:counter", {"batch_size": 4, "batch_timeout": 0.01}), name="counter", route_prefix=None)
    items = list(counter.options(stream=True).stream.remote(4))
    assert items == [(0, n) for n in range(1, 5)]
    # cancelling a streaming response withdraws the row from the replica's serving
    response = counter.options(stream=True).stream.remote(10_000)
    assert next(iter(response)) == (0, 1)
    response.cancel()
    wait_until(lambda: counter.stats.remote().result().cancelled == 1)
    wait_until(lambda: counter.stats.remote().result().running == 0)
    serve.delete("counter")


def test_200_concurrent_calls_through_a_handle_and_http(serve_instance):
    """2 replicas: every call answered, both replicas used, requests batched inside a replica."""
    httpx = pytest.importorskip("httpx")
    app = serving_app("pool_servings:probe", process_options={"batch_size": 16, "batch_timeout": 0.02},
                      num_replicas=2, ray_actor_options=LIGHT, name="probe", **QUICK_DELETE)
    handle = serve.run(app, name="probe", route_prefix="/probe")
    by_handle = [response.result(timeout_s=60) for response in [handle.run.remote(i) for i in range(200)]]

    async def over_http() -> list:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=serve_instance, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(http.post("/probe", json=i) for i in range(200)))

    responses = asyncio.run(over_http())
    assert [r.status_code for r in responses] == [200] * 200
    for answers in (by_handle, [r.json() for r in responses]):
        assert len({a["pid"] for a in answers}) == 2  # both replicas served
        assert max(a["rows"] for a in answers) > 1  # batched by the replica's serving (no @serve.batch)
    serve.delete("probe")


def test_check_health_fails_when_the_serving_is_stuck(ray_cluster):
    replica = ServingDeployment.func_or_class("pool_servings:sleeper", {"batch_size": 1, "batch_timeout": 0.0},
                                              stuck_after=0.3)
    try:
        replica.check_health()
        thread = threading.Thread(target=replica._handle.run, args=((6.0, "stuck", None),))  # long: a late wake-up
        thread.start()
        wait_until(lambda: replica._handle.stats().running == 1)  # its batch runs: no progress until it ends
        replica.check_health()  # progress noted
        time.sleep(0.5)  # > stuck_after; a busy machine only sleeps longer (the batch sleeps 6 s)
        with pytest.raises(RuntimeError, match="stuck"):
            replica.check_health()
        thread.join()
        replica.check_health()  # it finished: healthy again
        assert isinstance(replica._handle.run((0.0, "x", None)), dict)
    finally:
        replica._handle.close()


def test_overload_maps_to_max_ongoing_requests():
    app = serving_app("pool_servings:double", process_options={"batch_size": 2, "max_queue": 6})
    assert app._bound_deployment.max_ongoing_requests == 6


def test_openai_app_options_are_checked_before_any_replica_starts():
    from mlx_serving.server.ray import openai_app

    with pytest.raises(ValueError, match="model"):
        openai_app("pool_servings:double", model="")
    assert openai_app("pool_servings:double", model="m")._bound_deployment.max_ongoing_requests == 64
    app = openai_app("pool_servings:double", model="m", process_options={"max_queue": 6}, max_ongoing_requests=3)
    assert app._bound_deployment.max_ongoing_requests == 3  # an explicit deployment option wins


MODEL = "tiny"
OPTIONS = dict(max_new_tokens=8, max_len=320, max_batch=32)
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def tiny_serving(tiny_ckpt: Path):
    from mlx_serving import text_generation

    serving = text_generation.from_mlx4bit(tiny_ckpt, **OPTIONS)
    yield serving
    serving.close()


def test_openai_server_as_the_serve_ingress(serve_instance, tiny_ckpt, tiny_serving):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi", reason="the server extra (mlx-serving[server]) is not installed")
    from mlx_serving import Serving, text_generation
    from mlx_serving.server.ray import openai_app

    factory = functools.partial(text_generation.from_mlx4bit, str(tiny_ckpt), **OPTIONS)
    app = openai_app(factory, model=MODEL, process_options={"max_queue": 256}, num_replicas=2,
                     ray_actor_options={"num_cpus": 0}, name="openai", **QUICK_DELETE)
    assert app._bound_deployment.max_ongoing_requests == 256
    handle = serve.run(app, name="openai", route_prefix="/")
    client = openai.OpenAI(base_url=f"{serve_instance}/v1", api_key="unused", max_retries=0, timeout=60)

    def expected(input: dict) -> str:
        return tiny_serving.run(input)["results"][0]["generated_text"]

    # concurrent requests batch inside the replicas' servings (no @serve.batch on top): a replica's
    # serving ran fewer steps than its requests take one at a time
    prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(24)]
    with Serving.start(tiny_serving) as alone:
        alone.run({"messages": prompts[0], "max_new_tokens": 4})
        steps_alone = alone.stats().steps_run
    with ThreadPoolExecutor(24) as executor:
        replies = list(executor.map(
            lambda m: client.chat.completions.create(model=MODEL, messages=m, max_tokens=4), prompts))
    # the busiest of the replicas the handle picks (routing may leave one with a single request)
    stats = max((handle.stats.remote().result() for _ in range(8)), key=lambda st: st.completed)
    assert [r.choices[0].message.content for r in replies] == [
        expected({"messages": m, "max_new_tokens": 4}) for m in prompts]
    assert stats.completed >= 2 and stats.steps_run < steps_alone * stats.completed

    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert reply.choices[0].message.content == expected({"messages": MESSAGES, "max_new_tokens": 6})
    assert reply.model == MODEL and reply.usage.completion_tokens == 6
    sampled = dict(temperature=0.8, seed=3)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
                                                 **sampled))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected(
        {"messages": MESSAGES, "max_new_tokens": 6, **sampled})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text == expected({"text": "Once upon a time", "max_new_tokens": 5})
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{serve_instance}/health", timeout=30).json() == {"status": "ok"}
    metrics = httpx.get(f"{serve_instance}/metrics", timeout=30).text
    assert f'model_name="{MODEL}"' in metrics  # the replica's server metrics

    # a client that disconnects mid-stream: Serve cancels the replica's request, the row leaves
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=serve_instance, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            data = (line for line in response.iter_lines() if line.startswith("data:"))
            assert all('"finish_reason": null' in next(data) for _ in range(3))  # generating

    def withdrawn() -> bool:  # each stats call reaches one replica: poll until the one that held the row answers
        stats = handle.stats.remote().result()
        return stats.cancelled == 1 and stats.rows_in_flight == 0

    wait_until(withdrawn)
    serve.delete("openai")
