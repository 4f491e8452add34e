"""Serving runtime overhead and batching throughput (issue 2's two measurements).

(a) Per-request overhead of ``Serving.batched_run`` over calling the function directly, for a
    no-op backend (1 row, batch_size 1), one caller thread; p50/p99 in microseconds. Peer: the
    stdlib's ``ThreadPoolExecutor(1).submit(fn).result()`` round trip, measured in the same run.
(b) Throughput with 64 caller threads, batch_size 16, a backend costing a fixed 5 ms per batch
    (``time.sleep``), as a ratio to the same requests run one by one (direct calls).
Targets (issue 2): p50 overhead < 200 us; ratio >= 10x.

Run: ``.venv/bin/python bench/serving_overhead.py`` (writes bench/results/serving_overhead.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlx_serving.serving import Batch, Serving


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _latencies(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def overhead(n: int) -> dict:
    """Latency of a direct call, batched_run and a stdlib executor round trip (seconds)."""
    batch = Batch.stack([np.zeros(4, dtype=np.float32)])

    def noop(b: Batch):
        return b.data

    direct = _latencies(lambda: noop(batch), n)
    with Serving.new(noop).start(batch_size=1) as handle:
        _latencies(lambda: Serving.batched_run(handle, batch), 200)  # warm-up
        served = _latencies(lambda: Serving.batched_run(handle, batch), n)
    with ThreadPoolExecutor(1) as pool:
        _latencies(lambda: pool.submit(noop, batch).result(), 200)
        peer = _latencies(lambda: pool.submit(noop, batch).result(), n)
    base = statistics.median(direct)
    return {
        "requests": n,
        "direct_p50_us": base * 1e6,
        "batched_run_overhead_p50_us": (_percentile(served, 50) - base) * 1e6,
        "batched_run_overhead_p99_us": (_percentile(served, 99) - base) * 1e6,
        "executor_overhead_p50_us": (_percentile(peer, 50) - base) * 1e6,
        "executor_overhead_p99_us": (_percentile(peer, 99) - base) * 1e6,
    }


def throughput(threads: int, per_thread: int, batch_size: int, cost_s: float) -> dict:
    """Requests/s through batched_run from ``threads`` callers vs one by one."""
    calls = {"batches": 0}
    lock = threading.Lock()

    def fixed_cost(b: Batch):
        time.sleep(cost_s)
        with lock:
            calls["batches"] += 1
        return b.data

    batch = Batch.stack([np.zeros(4, dtype=np.float32)])
    total = threads * per_thread
    with Serving.new(fixed_cost).start(batch_size=batch_size, batch_timeout=0.005) as handle:
        barrier = threading.Barrier(threads + 1)

        def caller():
            barrier.wait()
            for _ in range(per_thread):
                Serving.batched_run(handle, batch)

        workers = [threading.Thread(target=caller) for _ in range(threads)]
        for w in workers:
            w.start()
        barrier.wait()
        start = time.perf_counter()
        for w in workers:
            w.join()
        batched_s = time.perf_counter() - start
        fill = handle.stats().mean_batch_fill
    start = time.perf_counter()
    for _ in range(total):
        fixed_cost(batch)
    sequential_s = time.perf_counter() - start
    return {
        "threads": threads,
        "requests": total,
        "batch_size": batch_size,
        "cost_ms": cost_s * 1e3,
        "batched_req_per_s": total / batched_s,
        "sequential_req_per_s": total / sequential_s,
        "ratio": sequential_s / batched_s,
        "mean_batch_fill": fill,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="sequential requests for (a)")
    parser.add_argument("--per-thread", type=int, default=10, help="requests per caller thread for (b)")
    args = parser.parse_args()
    a = overhead(args.requests)
    b = throughput(threads=64, per_thread=args.per_thread, batch_size=16, cost_s=0.005)
    print("(a) per-request overhead over a direct call, no-op backend, 1 caller (us)")
    print(f"{'path':<40}{'p50':>10}{'p99':>10}")
    print(f"{'Serving.batched_run':<40}{a['batched_run_overhead_p50_us']:>10.1f}{a['batched_run_overhead_p99_us']:>10.1f}")
    print(f"{'peer: ThreadPoolExecutor(1) round trip':<40}{a['executor_overhead_p50_us']:>10.1f}{a['executor_overhead_p99_us']:>10.1f}")
    print(f"ratio p50 ours/peer: {a['batched_run_overhead_p50_us'] / a['executor_overhead_p50_us']:.2f}   target: p50 < 200 us")
    print()
    print(f"(b) {b['threads']} threads, batch_size {b['batch_size']}, {b['cost_ms']:.0f} ms per batch, {b['requests']} requests")
    print(f"{'mode':<40}{'req/s':>10}")
    print(f"{'batched_run (64 threads)':<40}{b['batched_req_per_s']:>10.0f}")
    print(f"{'one by one (direct calls)':<40}{b['sequential_req_per_s']:>10.0f}")
    print(f"ratio: {b['ratio']:.1f}x (mean batch fill {b['mean_batch_fill']:.2f})   target: >= 10x")
    out = Path(__file__).parent / "results" / "serving_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overhead": a, "throughput": b}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
