"""Prometheus metrics under vLLM's names (prefix ``mlx_serving:``), fed by the runtime's own numbers.

Per request (observed when a completion's final item arrives; label ``model_name``):

- ``time_to_first_token_seconds``: arrival at the server -> first token, = queue time + the row's
  ``timing.prefill_ms`` (admission -> first token, measured by the runtime);
- ``inter_token_latency_seconds``: each gap between a row's consecutive tokens (``timing.itl_ms``,
  measured by the runtime as each token event arrives), so one stall shows as one slow gap;
- ``e2e_request_latency_seconds``: arrival -> the final item;
- ``request_queue_time_seconds``: e2e less the row's ``timing.total_ms`` (admission -> last token):
  waiting in the queue, preprocessing and transport;
- ``request_prefill_time_seconds`` / ``request_decode_time_seconds`` /
  ``request_inference_time_seconds``: the row's ``timing.prefill_ms`` / ``decode_ms`` /
  ``total_ms`` (admission -> first token, first -> last token, admission -> last token);
- ``request_prompt_tokens`` / ``request_generation_tokens`` (histograms: ``token_summary.input``,
  ``num_tokens``), ``prompt_tokens_total`` / ``generation_tokens_total`` (``token_summary.input`` once
  per prompt, ``num_tokens`` per completion), ``prompt_tokens_cached_total`` (``token_summary.cached``)
  and ``request_success_total{finished_reason}`` (``stop``, ``length``, ``tool_calls``; ``abort``
  for a request its client left).

Per embeddings request (``/v1/embeddings``), when it finished: ``embedding_inputs_total`` (inputs
embedded), ``prompt_tokens_total`` and ``request_prompt_tokens`` (the tokens of each input) and
``e2e_request_latency_seconds``.

Per request at arrival: ``request_params_n`` (completions asked for) and
``request_params_max_tokens`` (when the request gives it).

Read from ``Client.stats()`` at each scrape (no second bookkeeping): ``num_requests_running`` /
``num_requests_waiting`` (sequences: the engine's running ones, ``backend.seqs_running``; the
waiting ones, ``queued``: in the serving's queue or the engine's, each once),
``kv_cache_usage_perc`` (KV blocks used / total, a fraction in [0, 1] as in vLLM),
``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (prompt tokens looked up / found in
the prefix cache, as vLLM counts them), ``num_preemptions_total``,
``serving_requests_total{outcome}`` (the serving's ``completed``, ``failed``, ``cancelled``,
``expired``, ``rejected``) and ``iteration_tokens_total`` (a histogram of the tokens each engine
step computed, prefill and decode, from the backend's ``iteration_tokens_le_<bound>`` buckets);
with speculative decoding on, vLLM's ``spec_decode_num_drafts_total``,
``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` and
``spec_decode_num_accepted_tokens_per_pos_total{position}`` (the backend's ``spec_decode_*``).

Read from the model registry at each scrape (models loaded on demand, docs/server.md):
``model_loaded`` (a gauge per model: 1 while loaded, else 0; ``sum()`` is the number of loaded
models), ``model_loads_total{outcome}`` (loads that ended: ``ok`` or ``failed``) and
``model_unloads_total{reason}`` (``keep_alive``: idle past its keep-alive; ``evicted``: the least
recently used idle model, unloaded to make room under ``max_loaded_models``).

Histogram buckets are vLLM v1's (``vllm/v1/metrics/loggers.py``; token counts: its 1-2-5 series).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..serving import ServingStats

__all__ = ["PREFIX", "Lifecycle", "Metrics"]

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)

PREFIX = "mlx_serving:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_OUTCOMES = ("completed", "failed", "cancelled", "expired", "rejected")
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))  # 1 .. 5,000,000 (1-2-5)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)

StatsSource = Callable[[], Mapping[str, ServingStats]]


class Lifecycle(NamedTuple):
    """A served model's load state and history: ``loaded`` now, ``loads`` ended per outcome
    (``{"ok": n, "failed": n}``), ``unloads`` per reason (``{"keep_alive": n, "evicted": n}``)."""

    loaded: bool
    loads: Mapping[str, int]
    unloads: Mapping[str, int]


LifecycleSource = Callable[[], Mapping[str, Lifecycle]]


class Metrics:
    """The server's metrics registry. ``stats``: a function returning each loaded model's
    ``ServingStats``; ``lifecycle``: one returning each served model's ``Lifecycle`` (None: no
    lifecycle series) (both called at every scrape, on the scraping thread)."""

    def __init__(self, stats: StatsSource, lifecycle: LifecycleSource | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival -> first token (s).", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between decode tokens (s).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival -> last token (s).", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival -> admission into the engine (s).",
                               _LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Admission -> first token (s).", _LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First -> last token (s).", _LATENCY_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Admission -> last token (s).",
                                   _LATENCY_BUCKETS)
        self.prompt_hist = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.generation_hist = histogram("request_generation_tokens", "Generated tokens per completion.",
                                         _TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "Completions asked for per prompt (n).", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "max_tokens of requests that give it.",
                                           _TOKEN_BUCKETS)
        self.cached_tokens = Counter(PREFIX + "prompt_tokens_cached", "Prompt tokens found in the prefix cache.",
                                     labels, registry=self.registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.embedding_inputs = Counter(PREFIX + "embedding_inputs", "Inputs embedded (/v1/embeddings).", labels,
                                        registry=self.registry)
        self.success = Counter(PREFIX + "request_success", "Finished completions by finish reason.",
                               [*labels, "finished_reason"], registry=self.registry)
        self.registry.register(_StatsCollector(stats))
        if lifecycle is not None:
            self.registry.register(_LifecycleCollector(lifecycle))

    def finished(self, model: str, final: Mapping[str, Any], e2e_s: float, first_of_prompt: bool) -> None:
        """Observe one completion's final item (``e2e_s``: seconds since the request arrived;
        ``first_of_prompt``: count the prompt's tokens with this completion)."""
        self.success.labels(model, final["finish_reason"]).inc()
        tokens = int(final.get("num_tokens", 0))
        self.generation_tokens.labels(model).inc(tokens)
        self.generation_hist.labels(model).observe(tokens)
        summary = final.get("token_summary", {})
        if first_of_prompt:
            self.prompt_tokens.labels(model).inc(int(summary.get("input", 0)))
            self.prompt_hist.labels(model).observe(int(summary.get("input", 0)))
            self.cached_tokens.labels(model).inc(int(summary.get("cached", 0)))
        self.e2e.labels(model).observe(e2e_s)
        timing = final.get("timing")
        if not timing:
            return
        self.prefill.labels(model).observe(timing["prefill_ms"] / 1e3)
        self.decode.labels(model).observe(timing["decode_ms"] / 1e3)
        self.inference.labels(model).observe(timing["total_ms"] / 1e3)
        queue_s = max(e2e_s - timing["total_ms"] / 1e3, 0.0)
        self.queue.labels(model).observe(queue_s)
        self.ttft.labels(model).observe(queue_s + timing["prefill_ms"] / 1e3)
        itl = self.itl.labels(model)
        for gap_ms in timing.get("itl_ms", ()):
            itl.observe(gap_ms / 1e3)

    def embedded(self, model: str, tokens: list[int], e2e_s: float) -> None:
        """Observe one finished embeddings request: ``tokens`` per input, ``e2e_s`` seconds since
        it arrived (``embedding_inputs_total``, ``prompt_tokens_total``, ``request_prompt_tokens``,
        ``e2e_request_latency_seconds``)."""
        self.embedding_inputs.labels(model).inc(len(tokens))
        self.prompt_tokens.labels(model).inc(sum(tokens))
        for n in tokens:
            self.prompt_hist.labels(model).observe(n)
        self.e2e.labels(model).observe(e2e_s)

    def arrived(self, model: str, n: int, max_tokens: int | None) -> None:
        """Observe a request's parameters at arrival (``max_tokens`` None: the server's default)."""
        self.params_n.labels(model).observe(n)
        if max_tokens is not None:
            self.params_max_tokens.labels(model).observe(max_tokens)

    def aborted(self, model: str, completions: int) -> None:
        """Count completions whose client left before they finished."""
        if completions > 0:
            self.success.labels(model, "abort").inc(completions)

    def exposition(self) -> bytes:
        """The text exposition format (reads every model's stats: may block on a pool; call it off
        the event loop)."""
        return generate_latest(self.registry)


def _per_model(kind: type[_Family], name: str, doc: str) -> _Family:
    """A metric family ``PREFIX + name`` labelled by ``model_name`` only."""
    return kind(PREFIX + name, doc, labels=["model_name"])


class _StatsCollector(Collector):
    """Gauges and counters read from ``Client.stats()`` at scrape time."""

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        running = _per_model(GaugeMetricFamily, "num_requests_running", "Sequences running in the engine.")
        waiting = _per_model(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting in the queue.")
        usage = _per_model(GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache blocks in use (fraction, 0-1).")
        queries = _per_model(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = _per_model(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        preemptions = _per_model(CounterMetricFamily, "num_preemptions", "Sequences preempted for KV blocks.")
        outcomes = CounterMetricFamily(PREFIX + "serving_requests", "Requests ended, by outcome (ServingStats).",
                                       labels=["model_name", "outcome"])
        iteration = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens computed per engine step.",
                                          labels=["model_name"])
        spec = {name: _per_model(CounterMetricFamily, name, text) for name, text in _SPEC_COUNTERS}
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens per draft position.", labels=["model_name", "position"])
        for model, s in self._stats().items():
            kv = s.backend
            for name in spec if "spec_decode_num_drafts" in kv else ():
                spec[name].add_metric([model], kv.get(name, 0))
            for key, value in kv.items():
                if key.startswith(_PER_POS):
                    per_pos.add_metric([model, key[len(_PER_POS):]], value)
            # ServingStats.queued already counts the rows waiting in the engine's own queue
            running.add_metric([model], kv.get("seqs_running", s.running))
            waiting.add_metric([model], s.queued)
            if kv.get("blocks_total"):
                usage.add_metric([model], kv.get("blocks_used", 0) / kv["blocks_total"])
            queries.add_metric([model], kv.get("prefix_query_tokens", 0))
            hits.add_metric([model], kv.get("prefix_hit_tokens", 0))
            preemptions.add_metric([model], kv.get("preemptions", 0))
            for outcome in _OUTCOMES:
                outcomes.add_metric([model, outcome], getattr(s, outcome))
            buckets = _iteration_buckets(kv)
            if buckets:
                iteration.add_metric([model], buckets, kv.get("iteration_tokens_sum", 0))
        yield from (running, waiting, usage, queries, hits, preemptions, outcomes, iteration)
        yield from (m for m in (*spec.values(), per_pos) if m.samples)  # only with speculation on


_SPEC_COUNTERS = (("spec_decode_num_drafts", "Speculative verifies (drafts) run."),
                  ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                  ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"


class _LifecycleCollector(Collector):
    """``model_loaded``, ``model_loads_total`` and ``model_unloads_total`` read at scrape time."""

    def __init__(self, lifecycle: LifecycleSource) -> None:
        self._lifecycle = lifecycle

    def collect(self) -> Iterator[Metric]:
        loaded = _per_model(GaugeMetricFamily, "model_loaded", "1 while the model is loaded, else 0.")
        loads = CounterMetricFamily(PREFIX + "model_loads", "Model loads ended, by outcome (ok, failed).",
                                    labels=["model_name", "outcome"])
        unloads = CounterMetricFamily(PREFIX + "model_unloads", "Model unloads, by reason (keep_alive, evicted).",
                                      labels=["model_name", "reason"])
        for model, life in self._lifecycle().items():
            loaded.add_metric([model], 1 if life.loaded else 0)
            for outcome in ("ok", "failed"):
                loads.add_metric([model, outcome], life.loads.get(outcome, 0))
            for reason in ("keep_alive", "evicted"):
                unloads.add_metric([model, reason], life.unloads.get(reason, 0))
        yield from (loaded, loads, unloads)


def _iteration_buckets(backend: Mapping[str, float]) -> list[tuple[str, float]]:
    """``[(bound, cumulative count), ...]`` from the backend's ``iteration_tokens_le_<bound>`` keys,
    by bound (``+Inf`` last); empty when it reports none."""
    prefix = "iteration_tokens_le_"
    found = [(key[len(prefix):], value) for key, value in backend.items() if key.startswith(prefix)]
    return sorted(found, key=lambda bv: float(bv[0]))
