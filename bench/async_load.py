"""Streaming load: many concurrent clients on the tiny Qwen3 checkpoint, sync vs async paths.

Each of ``--clients`` clients streams ``--requests`` generations (``--max-new-tokens`` tokens,
greedy, a distinct prompt each) through one started text-generation serving, all clients
starting together. Paths, measured in the same run on the same handle:

- sync: one thread per client, ``Serving.stream`` (the peer);
- async: one task per client in one event loop, ``Serving.stream_async`` (asyncio, then trio).

Per path: TTFT (call -> first text piece) and inter-token latency (gap between consecutive text
pieces of one stream, the latency a client sees) as p50/p99 over all requests/gaps, aggregate
generated tokens/s (all tokens / wall time from the first call to the last final event), mean
batch fill, for async paths the event loop's lag (extra delay of a 10 ms heartbeat task: p99
and max), the client side's CPU time per generated token in microseconds (the caller threads',
or the event loop thread's, heartbeat included: receiving, detokenizing, bookkeeping), and the
machine's own stall during the run (largest extra delay of a separate process sleeping 10 ms at
a time; on a shared machine the OS sometimes stalls every process at once).
Each path runs ``--rounds`` times, the order rotated each round; the table shows per-metric
medians, and each async path's ratio to sync is taken within each round, then the median.
A last row runs ``--baseline`` requests one at a time (no concurrency) for reference.

Run: ``.venv/bin/python bench/async_load.py`` (writes bench/results/async_load.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# bench/ holds scripts named like the packages (bench/tokenization.py): keep it off sys.path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from mlx_serving.models import text_generation  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.serving import Serving, ServingHandle  # noqa: E402

_WORDS = ("river", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "quartz", "ember", "violet")


@dataclass
class Trace:
    """One streamed request: call time, arrival time of each text piece, tokens generated (s)."""

    called: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    done: float = 0.0


def _prompt(client: int, request: int) -> str:
    words = " ".join(_WORDS[(client * 7 + request * 3 + k) % len(_WORDS)] for k in range(6))
    return f"Client {client}, request {request}: {words}"


def _record(trace: Trace, item: Any) -> None:
    if isinstance(item, str):
        trace.arrivals.append(time.perf_counter())
    else:
        trace.tokens, trace.done = item["num_tokens"], time.perf_counter()


def run_sync(handle: ServingHandle, clients: int, requests: int, n: int) -> tuple[list[Trace], dict[str, Any]]:
    """One thread per client, ``Serving.stream``."""
    traces: list[Trace] = []
    cpu: list[float] = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        barrier.wait()
        start = time.thread_time()
        for r in range(requests):
            trace = Trace(time.perf_counter())
            for item in Serving.stream(handle, {"text": _prompt(c, r), "max_new_tokens": n}):
                _record(trace, item)
            traces.append(trace)
        cpu.append(time.thread_time() - start)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return traces, {"client_cpu_s": sum(cpu)}


def run_async(handle: ServingHandle, clients: int, requests: int, n: int, backend: str) -> tuple[list[Trace], dict[str, Any]]:
    """One task per client, ``Serving.stream_async``, plus a 10 ms heartbeat task (loop lag)."""
    traces: list[Trace] = []
    gaps: list[float] = []

    async def client(c: int, go: anyio.Event) -> None:
        await go.wait()
        for r in range(requests):
            trace = Trace(time.perf_counter())
            async for item in await Serving.stream_async(handle, {"text": _prompt(c, r), "max_new_tokens": n}):
                _record(trace, item)
            traces.append(trace)

    async def heartbeat(stop: anyio.Event) -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await anyio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last - 0.01)
            last = now

    async def main() -> float:
        start = time.thread_time()
        go, stop = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, stop)
            async with anyio.create_task_group() as calls:
                for c in range(clients):
                    calls.start_soon(client, c, go)
                go.set()
            stop.set()
        return time.thread_time() - start

    cpu = anyio.run(main, backend=backend)
    return traces, {"client_cpu_s": cpu, "loop_lag_p99_ms": _pct(gaps, 99) * 1e3,
                    "loop_lag_max_ms": max(gaps) * 1e3}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(traces: list[Trace], extra: dict[str, Any], stats_before: Any, stats_after: Any) -> dict[str, Any]:
    """TTFT / inter-token percentiles (ms), tokens/s, batch fill over this run's steps."""
    ttft = [t.arrivals[0] - t.called for t in traces if t.arrivals]
    itl = [b - a for t in traces for a, b in zip(t.arrivals, t.arrivals[1:])]
    tokens = sum(t.tokens for t in traces)
    wall = max(t.done for t in traces) - min(t.called for t in traces)
    steps = stats_after.steps_run - stats_before.steps_run
    fill_sum = stats_after.mean_batch_fill * stats_after.steps_run - stats_before.mean_batch_fill * stats_before.steps_run
    return {
        "requests": len(traces),
        "tokens": tokens,
        "client_cpu_us_per_token": extra.pop("client_cpu_s") / tokens * 1e6,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "ttft_p50_ms": _pct(ttft, 50) * 1e3,
        "ttft_p99_ms": _pct(ttft, 99) * 1e3,
        "itl_p50_ms": _pct(itl, 50) * 1e3,
        "itl_p99_ms": _pct(itl, 99) * 1e3,
        "steps": steps,
        "mean_batch_fill": fill_sum / steps if steps else 0.0,
        **extra,
    }


# A separate process that sleeps 10 ms at a time until its stdin closes, then prints the largest
# extra delay it saw (s): how long the machine itself stalled processes during a run.
_STALL_PROBE = """
import select, sys, time
last, worst = time.perf_counter(), 0.0
while not select.select([sys.stdin], [], [], 0.01)[0]:
    now = time.perf_counter()
    worst, last = max(worst, now - last - 0.01), now
print(worst)
"""


def run_path(handle: ServingHandle, path: str, clients: int, requests: int, n: int) -> dict[str, Any]:
    """One path's summary, with the machine's stall (``_STALL_PROBE``) measured alongside."""
    before = handle.stats()
    probe = subprocess.Popen([sys.executable, "-c", _STALL_PROBE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    if path == "sync":
        traces, extra = run_sync(handle, clients, requests, n)
    else:
        traces, extra = run_async(handle, clients, requests, n, path.split("-")[1])
    stall = float(probe.communicate("", timeout=10)[0])
    return summarize(traces, {**extra, "machine_stall_max_ms": stall * 1e3}, before, handle.stats())


PATHS = ("sync", "async-asyncio", "async-trio")


def measure(serving: Serving, clients: int, requests: int, n: int, rounds: int,
            baseline: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Every path ``rounds`` times on one started handle (order rotated each round, after a
    warm-up request); returns the per-metric median over rounds and every round's numbers."""
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    with Serving.start(serving) as handle:
        for _ in Serving.stream(handle, "warm up"):  # first-step costs
            pass
        for r in range(rounds):
            for path in PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]:
                runs[path].append(run_path(handle, path, clients, requests, n))
                print(f"round {r + 1} {path}: {runs[path][-1]['tok_per_s']:.1f} tok/s", flush=True)
        if baseline:
            runs["one-at-a-time"] = [run_path(handle, "sync", 1, baseline, n)]
    medians = {p: {k: float(np.median([x[k] for x in rs])) for k in rs[0]} for p, rs in runs.items()}
    return medians, runs


def paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """For each async path: the median over rounds of (async metric / sync metric in the same
    round); pairing by round cancels most of the load changes between rounds."""
    metrics = ("tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    return {p: {m: float(np.median([a[m] / s[m] for a, s in zip(runs[p], runs["sync"])])) for m in metrics}
            for p in PATHS[1:]}


def _row(name: str, r: dict[str, Any]) -> str:
    lag = f"{r['loop_lag_p99_ms']:>9.1f}{r['loop_lag_max_ms']:>9.1f}" if "loop_lag_max_ms" in r else f"{'-':>9}{'-':>9}"
    return (f"{name:<34}{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}{r['itl_p50_ms']:>9.0f}"
            f"{r['itl_p99_ms']:>9.0f}{r['tok_per_s']:>9.1f}{r['mean_batch_fill']:>7.2f}{lag}"
            f"{r['machine_stall_max_ms']:>9.1f}{r['client_cpu_us_per_token']:>8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=64, help="KV slots = most rows decoding at once")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each path; the table shows medians")
    parser.add_argument("--baseline", type=int, default=4, help="requests run one at a time (0: skip)")
    parser.add_argument("--dense", action="store_true", help="float32 checkpoint instead of 4-bit")
    args = parser.parse_args()
    n = args.max_new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        kind = dict(quantized=False, dtype="float32") if args.dense else {}
        ckpt = write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0, **kind)
        serving = text_generation.from_mlx4bit(ckpt, max_new_tokens=n, max_len=128, max_batch=args.max_batch)
        results, runs = measure(serving, args.clients, args.requests, n, args.rounds, args.baseline)
    print(f"\n{args.clients} clients x {args.requests} request(s), {n} new tokens each, max_batch "
          f"{args.max_batch}, tiny Qwen3 ({'float32' if args.dense else '4-bit'}), greedy; "
          f"median of {args.rounds} rounds (ms, tokens/s)")
    print(f"{'path':<34}{'TTFT50':>9}{'TTFT99':>9}{'ITL50':>9}{'ITL99':>9}{'tok/s':>9}{'fill':>7}{'lag99':>9}{'lag max':>9}{'stall':>9}{'cpu/tok':>8}")
    names = {"sync": "sync: threads + Serving.stream", "async-asyncio": "async: stream_async (asyncio)",
             "async-trio": "async: stream_async (trio)", "one-at-a-time": "one request at a time (sync)"}
    for key, r in results.items():
        print(_row(names[key], r))
    ratios = paired_ratios(runs)
    print("async / sync, median over rounds of the ratio within one round (same machine load):")
    for key, r in ratios.items():
        print(f"  {key}: tok/s {r['tok_per_s']:.2f}, TTFT p50 {r['ttft_p50_ms']:.2f}, "
              f"TTFT p99 {r['ttft_p99_ms']:.2f}, ITL p50 {r['itl_p50_ms']:.2f}")
    print("tok/s per round: " + "; ".join(f"{k} {[round(x['tok_per_s']) for x in runs[k]]}" for k in PATHS))
    out = Path(__file__).parent / "results" / "async_load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "median": results, "paired_ratios": ratios,
                               "rounds": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
