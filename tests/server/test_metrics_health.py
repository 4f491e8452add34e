"""``/metrics`` (parsed with prometheus-client's parser: counts match the requests made; every
series the Grafana dashboard in docs/grafana queries exists) and ``/health`` (503 while loading,
503 when a serving holds rows without progress, 200 otherwise)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import openai

from mlx_serving import Batch, Serving
from mlx_serving.server import create_app

from server_helpers import MODEL, Server, metric_samples, serve, wait_for

LABELS = (("model_name", MODEL),)


def _delta(after: dict, before: dict, name: str, labels: tuple = LABELS) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def test_metrics_count_the_requests_made(server: Server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    wait_for(lambda: server.handle.stats().rows_in_flight == 0, what="an idle server")
    before = metric_samples(server.url)
    usages = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}],
                                             max_tokens=3 + i).usage for i in range(3)]
    streamed = client.completions.create(model=MODEL, prompt="stream me", max_tokens=5, stream=True,
                                         stream_options={"include_usage": True})
    usages.append([c for c in streamed][-1].usage)
    after = metric_samples(server.url)
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert generated == 3 + 4 + 5 + 5
    assert _delta(after, before, "mlx_serving:prompt_tokens_total") == prompt
    assert _delta(after, before, "mlx_serving:generation_tokens_total") == generated
    length = (("finished_reason", "length"), ("model_name", MODEL))
    assert _delta(after, before, "mlx_serving:request_success_total", length) == 4
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert _delta(after, before, f"mlx_serving:{histogram}_count") == 4, histogram
        assert _delta(after, before, f"mlx_serving:{histogram}_sum") > 0, histogram
    assert _delta(after, before, "mlx_serving:inter_token_latency_seconds_count") == generated - 4
    assert after[("mlx_serving:num_requests_running", LABELS)] == 0
    assert after[("mlx_serving:num_requests_waiting", LABELS)] == 0
    kv = server.handle.stats().backend
    assert after[("mlx_serving:prefix_cache_queries_total", LABELS)] == kv["prefix_query_tokens"] > 0
    assert after[("mlx_serving:prefix_cache_hits_total", LABELS)] == kv["prefix_hit_tokens"]
    completed = (("model_name", MODEL), ("outcome", "completed"))
    assert after[("mlx_serving:serving_requests_total", completed)] == server.handle.stats().completed
    for histogram in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                      "request_params_max_tokens"):
        assert _delta(after, before, f"mlx_serving:{histogram}_count") == 4, histogram
    assert _delta(after, before, "mlx_serving:request_generation_tokens_sum") == generated
    assert _delta(after, before, "mlx_serving:request_params_max_tokens_sum") == 3 + 4 + 5 + 5
    cached = _delta(after, before, "mlx_serving:prompt_tokens_cached_total")
    assert cached == sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    # tokens per engine step: each prompt's uncached tokens once, then one per decode step of each row
    computed = _delta(after, before, "mlx_serving:iteration_tokens_total_sum")
    assert computed == prompt - cached + generated - 4
    steps = _delta(after, before, "mlx_serving:iteration_tokens_total_count")
    assert 3 + 4 + 5 + 5 - 4 <= steps <= computed
    le_inf = (("le", "+Inf"), ("model_name", MODEL))
    assert _delta(after, before, "mlx_serving:iteration_tokens_total_bucket", le_inf) == steps


def test_waiting_and_running_count_each_sequence_once(tiny_ckpt: Path):
    """8 streams on a 2-sequence engine: 2 running, 6 waiting (in the engine's own queue, where the
    serving hands its rows), each counted once."""
    from mlx_serving import text_generation

    serving = text_generation.from_mlx4bit(tiny_ckpt, max_new_tokens=4000, max_len=4100, max_batch=2)
    with Serving.start(serving) as handle, serve(create_app({MODEL: handle})) as url:
        streams = [handle.stream({"text": f"q{i}", "ignore_eos": True}) for i in range(8)]
        try:
            wait_for(lambda: handle.stats().running == 2 and handle.stats().queued == 6, what="2 running, 6 waiting")
            samples = metric_samples(url)
            assert samples[("mlx_serving:num_requests_running", LABELS)] == 2
            assert samples[("mlx_serving:num_requests_waiting", LABELS)] == 6
        finally:
            for stream in streams:
                stream.close()
    serving.close()


def test_itl_is_observed_per_gap():
    """One 0.9 s stall among 1 ms gaps lands in the 0.75-1 s bucket, not in a mean of ~0.2 s."""
    from mlx_serving.server._metrics import Metrics

    metrics = Metrics(dict)
    final = {"finish_reason": "length", "num_tokens": 5, "token_summary": {"input": 2, "output": 5},
             "timing": {"prefill_ms": 5.0, "decode_ms": 903.0, "total_ms": 908.0, "itl_ms": [1.0, 900.0, 1.0, 1.0]}}
    metrics.finished("m", final, 1.0, True)
    itl = {s.labels["le"]: s.value for m in metrics.registry.collect() if m.name == "mlx_serving:inter_token_latency_seconds"
           for s in m.samples if s.name.endswith("_bucket")}
    assert itl["0.01"] == 3 and itl["0.75"] == 3 and itl["1.0"] == 4


DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "mlx-serving.json"


def test_every_series_the_grafana_dashboard_queries_is_exported(server: Server):
    """Each metric name in the dashboard's PromQL (and its model variable's query) is a sample of
    ``/metrics`` after one request (histograms as their _bucket / _sum / _count)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    client.completions.create(model=MODEL, prompt="dashboard", max_tokens=3)
    exported = {name for name, _ in metric_samples(server.url)}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    names = {n for q in queries for n in re.findall(r"mlx_serving:[A-Za-z0-9_:]+", q)}
    assert len(queries) >= 20 and len(names) >= 20
    missing = sorted(names - exported)
    assert not missing, missing
    assert all('model_name="$model_name"' in q for q in queries if "label_values" not in q)


def test_health_ok(server: Server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_health_is_503_while_loading(tiny_serving: Serving):
    release = threading.Event()

    def load() -> dict:
        release.wait(30)
        return {MODEL: Serving.start(tiny_serving)}  # the app closes what its loader built

    with serve(create_app(load)) as url:
        loading = httpx.get(f"{url}/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        assert "the models are loading" in loading.json()["detail"]
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        release.set()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="the model to load")
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_health_is_503_when_loading_failed():
    errors: list[BaseException] = []

    def load() -> dict:
        raise FileNotFoundError("no checkpoint at /nowhere")

    with serve(create_app(load, on_load_error=errors.append)) as url:
        wait_for(lambda: httpx.get(f"{url}/health").json()["status"] == "failed", what="the failure")
        body = httpx.get(f"{url}/health").json()
        assert "no checkpoint at /nowhere" in body["error"] and "loading the models failed" in body["detail"]
    assert isinstance(errors[0], FileNotFoundError)


def test_health_is_503_when_the_serving_is_stuck():
    """A serving whose backend never returns holds a row without progress: 'stuck' after stuck_after s."""
    unblock = threading.Event()

    def hang(batch):  # a real backend that hangs until released
        unblock.wait(30)
        return batch.data

    with Serving.start(Serving.new(hang), batch_size=1, batch_timeout=0.0) as handle:
        with serve(create_app({"hang": handle}, stuck_after=0.2)) as url:
            assert httpx.get(f"{url}/health").status_code == 200
            pending = threading.Thread(target=handle.run, args=(Batch.stack([[0]]),))
            pending.start()
            wait_for(lambda: handle.stats().running == 1, what="the batch to start")
            httpx.get(f"{url}/health")  # first look at this progress
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, what="the stuck verdict")
            body = httpx.get(f"{url}/health").json()
            assert body["status"] == "stuck" and body["model"] == "hang"
            unblock.set()
            pending.join(10)
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="recovery")
