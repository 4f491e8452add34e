"""A client that disconnects withdraws its request (its row leaves the engine; the serving counts it
cancelled); 200 concurrent streaming clients, some leaving at random, all end and the gauges
return to 0."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import openai
import pytest

from server_helpers import MODEL, Server, metric_samples, wait_for

LONG = 300  # tokens: the tiny model never reaches EOS this early, so the request is still running


def _idle(server: Server) -> bool:
    stats = server.handle.stats()
    return stats.rows_in_flight == 0


def test_disconnect_mid_stream_cancels_the_row(server: Server):
    before = server.handle.stats()
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": LONG, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            data = (line for line in response.iter_lines() if line.startswith("data:"))
            first = [next(data) for _ in range(3)]  # three chunks: generating
            assert all('"finish_reason": null' in chunk for chunk in first)
            assert server.handle.stats().running == 1
            assert metric_samples(server.url)[("mlx_serving:num_requests_running", (("model_name", MODEL),))] == 1
        # leaving the block closed the connection mid-stream
    wait_for(lambda: server.handle.stats().cancelled == before.cancelled + 1, what="the request to be cancelled")
    after = server.handle.stats()
    assert after.running == 0 and after.completed == before.completed
    wait_for(lambda: server.handle.stats().backend["blocks_used"] == 0, what="its KV blocks to be returned")
    abort = ("mlx_serving:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    wait_for(lambda: metric_samples(server.url).get(abort, 0) >= 1, what="the abort to be counted")


def test_disconnect_while_waiting_for_a_whole_response(server: Server):
    before = server.handle.stats()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": LONG}
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        # leave once the row is generating (polled every 1 ms: 300 tokens take far longer than that)
        end = time.monotonic() + 20
        while server.handle.stats().running == before.running:
            assert time.monotonic() < end, "the request never started"
            time.sleep(0.001)
    wait_for(lambda: server.handle.stats().cancelled == before.cancelled + 1, what="the request to be cancelled")
    after = server.handle.stats()
    assert after.running == 0 and after.completed == before.completed


@pytest.mark.asyncio
async def test_200_concurrent_streams_with_random_disconnects(server: Server):
    wait_for(lambda: _idle(server), what="an idle server")
    before = server.handle.stats()
    rng = random.Random(0)
    plans = [(rng.randint(2, 6), rng.random() < 0.3) for _ in range(200)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(i: int, max_tokens: int, leave: bool) -> str:
        stream = await client.completions.create(model=MODEL, prompt=f"client {i}", max_tokens=max_tokens,
                                                 stream=True)
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish
            if leave:
                await stream.close()  # closes the connection after the first chunk
                return "left"
        return finish

    outcomes = await asyncio.wait_for(asyncio.gather(*(one(i, *p) for i, p in enumerate(plans))), timeout=120)
    await client.close()
    assert [o for o, (_, leave) in zip(outcomes, plans) if not leave] == ["length"] * sum(not p[1] for p in plans)
    wait_for(lambda: _idle(server), what="every row to leave")
    after = server.handle.stats()
    ended = (after.completed - before.completed) + (after.cancelled - before.cancelled)
    assert ended == 200 and after.failed == before.failed
    assert after.cancelled - before.cancelled <= sum(leave for _, leave in plans)
    samples = metric_samples(server.url)
    labels = (("model_name", MODEL),)
    assert samples[("mlx_serving:num_requests_running", labels)] == 0
    assert samples[("mlx_serving:num_requests_waiting", labels)] == 0
    assert samples[("mlx_serving:kv_cache_usage_perc", labels)] == 0
