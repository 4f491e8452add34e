"""ServingPool: throughput of 1 vs 2 worker processes, and the per-request overhead of the pool.

(a) Throughput for a CPU-bound backend that holds the GIL (a pure-Python loop, about 20 ms per
    row), batch_size 1, 16 caller threads, 96 requests, best of 3 rounds (each round runs every
    path in turn, so background load hits them alike). Rows: a local
    ``ServingHandle`` with 1 and 2 partitions (one process: the GIL serialises them), the pool with
    1 and 2 workers, and the peer ``concurrent.futures.ProcessPoolExecutor(2)`` (spawn) running the
    same function without batching. Target (issue 6): pool 2 workers / pool 1 worker >= 1.7x.
(c) Throughput of the tiny seeded Qwen3 (4-bit) text-generation serving (``models.text_generation.
    from_mlx4bit``), 16 caller threads, 32 prompts, 16 new tokens each (greedy), best of 2
    rounds: local handle vs pool with 1 and 2 workers (MLX CPU build).
(b) Per-request latency, one caller, 2000 sequential requests, no-op backend (returns its input),
    batch_size 1, batch_timeout 0; p50/p99 in microseconds for a 16-float input and a 1 MiB
    float32 array. Rows: the local handle's ``batched_run``, ``ServingPool.run`` (1 worker), and
    the peer ``ProcessPoolExecutor(1).submit(fn, x).result()``. The pool's overhead is its p50
    minus the local handle's.

(d) The Ray backend (``ServingPool(..., backend="ray")``, needs ray) against the process pool on
    the same 2 workers: (a)'s CPU-bound throughput, and (b)'s per-request latency (no-op
    backend, 16 floats and 1 MiB, one caller) with 1 worker each. A local Ray cluster
    (``ray.init(num_cpus=2, include_dashboard=False)``), actors with ``num_cpus=0``.

Run: ``.venv/bin/python bench/pool.py`` (writes bench/results/pool.json); ``--parts d`` for the
Ray comparison only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

# bench/ holds scripts named like the packages (bench/tokenization.py): keep the script's folder
# off the import path, here and in the spawned workers (they inherit sys.path)
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from mlx_serving.serving import Batch, Serving  # noqa: E402
from mlx_serving.serving import ServingPool  # noqa: E402

_SPAWN = multiprocessing.get_context("spawn")  # the peer starts its processes as the pool does
LOOP = 400_000  # iterations of the pure-Python loop per row (~20 ms on the development machine)


def spin(seed: int) -> float:
    """CPU-bound pure-Python work that holds the GIL."""
    acc = 0.0
    for i in range(LOOP):
        acc += (i * seed) % 7
    return acc


def _one(value: Any) -> tuple[Batch, None]:
    return Batch.stack([value]), None


def _first(output_metadata: tuple[Any, Any], info: Any) -> Any:
    return output_metadata[0][0]


def cpu_serving() -> Serving:
    return Serving.new(lambda batch: [spin(seed) for seed in batch.rows()]).client_preprocessing(_one).client_postprocessing(_first)


def noop(value: Any) -> Any:
    return value


def noop_serving() -> Serving:
    return Serving.new(lambda batch: batch.rows()).client_preprocessing(_one).client_postprocessing(_first)


def _rate(call, requests: int, callers: ThreadPoolExecutor) -> float:
    start = time.perf_counter()
    list(callers.map(call, range(1, requests + 1)))
    return requests / (time.perf_counter() - start)


def _latency_us(call, value: Any, n: int) -> tuple[float, float]:
    for _ in range(50):
        call(value)
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        call(value)
        samples.append(time.perf_counter() - start)
    p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
    return float(p50), float(p99)


def throughput(requests: int, rounds: int) -> dict[str, float]:
    """Best req/s per path; every round measures every path in turn (fair under shared cores)."""
    options = {"batch_size": 1, "batch_timeout": 0.0}
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        local1 = enter(Serving.start(cpu_serving(), partitions=1, **options))
        local2 = enter(Serving.start(cpu_serving(), partitions=2, **options))
        pool1 = enter(ServingPool(cpu_serving, workers=1, **options))
        pool2 = enter(ServingPool(cpu_serving, workers=2, **options))
        peer = enter(ProcessPoolExecutor(2, mp_context=_SPAWN))
        list(peer.map(spin, [1, 2]))  # both processes up before timing
        paths = {
            "local_1_partitions": local1.batched_run,
            "local_2_partitions": local2.batched_run,
            "pool_1_workers": pool1.run,
            "pool_2_workers": pool2.run,
            "peer_process_pool_2": lambda s: peer.submit(spin, s).result(),
        }
        callers = enter(ThreadPoolExecutor(16))
        best = dict.fromkeys(paths, 0.0)
        for _ in range(rounds):
            for path, call in paths.items():
                best[path] = max(best[path], _rate(call, requests, callers))
    return best


def qwen3_throughput(requests: int, rounds: int) -> dict[str, float]:
    """Generated tokens/s per path, tiny seeded Qwen3 (best of ``rounds``, paths in turn)."""
    from mlx_serving.models.seeded_checkpoint import write_checkpoint
    from mlx_serving.models.text_generation import from_mlx4bit

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        factory = functools.partial(from_mlx4bit, write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0),
                                    max_new_tokens=8)
        enter = stack.enter_context
        paths = {
            "local_handle": enter(Serving.start(factory())).batched_run,
            "pool_1_workers": enter(ServingPool(factory, workers=1)).run,
            "pool_2_workers": enter(ServingPool(factory, workers=2)).run,
        }
        callers = enter(ThreadPoolExecutor(16))
        prompts = [f"Request {i}: count to ten." for i in range(requests)]
        best = dict.fromkeys(paths, 0.0)
        for _ in range(rounds):
            for path, call in paths.items():
                start = time.perf_counter()
                outputs = list(callers.map(call, prompts))
                tokens = sum(r["num_tokens"] for out in outputs for r in out["results"])
                best[path] = max(best[path], tokens / (time.perf_counter() - start))
    return best


def latency(n: int) -> dict[str, dict[str, float]]:
    inputs = {"16 floats": np.ones(16, np.float32), "1 MiB array": np.ones(1 << 18, np.float32)}
    options = {"batch_size": 1, "batch_timeout": 0.0}
    out: dict[str, dict[str, float]] = {}
    with Serving.start(noop_serving(), **options) as handle, ServingPool(noop_serving, workers=1, **options) as pool:
        with ProcessPoolExecutor(1, mp_context=_SPAWN) as peer:
            paths = {
                "local handle batched_run": handle.batched_run,
                "ServingPool.run (1 worker)": pool.run,
                "peer ProcessPoolExecutor(1)": lambda x: peer.submit(noop, x).result(),
            }
            for label, value in inputs.items():
                for path, call in paths.items():
                    p50, p99 = _latency_us(call, value, n)
                    out[f"{path} / {label}"] = {"p50_us": p50, "p99_us": p99}
    return out


def ray_backend(requests: int, rounds: int, n: int) -> dict[str, Any]:
    """(d): process pool vs Ray pool, throughput (2 workers) and latency (1 worker)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    options = {"batch_size": 1, "batch_timeout": 0.0}
    ray_options = {"backend": "ray", "ray_actor_options": {"num_cpus": 0}}
    out: dict[str, Any] = {}
    try:
        with contextlib.ExitStack() as stack:
            enter = stack.enter_context
            paths = {
                "process pool, 2 workers": enter(ServingPool(cpu_serving, workers=2, **options)).run,
                "Ray pool, 2 actors": enter(ServingPool(cpu_serving, workers=2, **ray_options, **options)).run,
            }
            callers = enter(ThreadPoolExecutor(16))
            best = dict.fromkeys(paths, 0.0)
            for _ in range(rounds):
                for path, call in paths.items():
                    best[path] = max(best[path], _rate(call, requests, callers))
            out["throughput_req_per_s"] = best
        inputs = {"16 floats": np.ones(16, np.float32), "1 MiB array": np.ones(1 << 18, np.float32)}
        with ServingPool(noop_serving, workers=1, **options) as pool, \
                ServingPool(noop_serving, workers=1, **ray_options, **options) as ray_pool:
            paths = {"ServingPool.run (process, 1 worker)": pool.run, "ServingPool.run (Ray, 1 actor)": ray_pool.run}
            latencies = {}
            for label, value in inputs.items():
                for path, call in paths.items():
                    p50, p99 = _latency_us(call, value, n)
                    latencies[f"{path} / {label}"] = {"p50_us": p50, "p99_us": p99}
            out["latency"] = latencies
    finally:
        ray.shutdown()
    return out


def _print_ray(d: dict[str, Any], requests: int, rounds: int, n: int) -> None:
    print(f"(d) Ray backend vs process pool; CPU-bound, 16 threads, {requests} requests, best of {rounds} (req/s)")
    for path, value in d["throughput_req_per_s"].items():
        print(f"{path:<36}{value:>10.1f}")
    print(f"latency, no-op backend, 1 caller, {n} requests (us)")
    print(f"{'path / input':<56}{'p50':>10}{'p99':>10}")
    for path, value in d["latency"].items():
        print(f"{path:<56}{value['p50_us']:>10.1f}{value['p99_us']:>10.1f}")


def _print_throughput(a: dict[str, float], requests: int, rounds: int) -> None:
    print(f"(a) CPU-bound backend (~20 ms/row, holds the GIL), 16 threads, {requests} requests, best of {rounds}")
    print(f"{'path':<36}{'req/s':>10}")
    for path, value in a.items():
        print(f"{path:<36}{value:>10.1f}")
    print(f"pool 2 workers / 1 worker: {a['pool_2_workers'] / a['pool_1_workers']:.2f}x (target >= 1.7x); "
          f"pool 2 / peer ProcessPoolExecutor(2): {a['pool_2_workers'] / a['peer_process_pool_2']:.2f}")


def _print_qwen3(c: dict[str, float]) -> None:
    print("(c) tiny Qwen3 4-bit text generation, 16 threads, 16 prompts x 8 new tokens (tokens/s)")
    for path, value in c.items():
        print(f"{path:<36}{value:>10.1f}")
    print(f"pool 2 workers / 1 worker: {c['pool_2_workers'] / c['pool_1_workers']:.2f}x; "
          f"pool 1 worker / local handle: {c['pool_1_workers'] / c['local_handle']:.2f}")


def _print_latency(b: dict[str, dict[str, float]], requests: int) -> None:
    print(f"(b) latency, no-op backend, 1 caller, {requests} requests (us)")
    print(f"{'path / input':<56}{'p50':>10}{'p99':>10}")
    for path, value in b.items():
        print(f"{path:<56}{value['p50_us']:>10.1f}{value['p99_us']:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-requests", type=int, default=2000)
    parser.add_argument("--parts", default="abc", help="which measurements to run, e.g. 'a' or 'ab' ('d': the Ray backend)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pool.json"))
    args = parser.parse_args()

    report: dict[str, object] = {"load_average_1min_before": os.getloadavg()[0]}
    print(f"1-minute load average before the run: {report['load_average_1min_before']:.2f} (2 cores)")
    if "a" in args.parts:
        report["throughput_req_per_s"] = a = throughput(args.requests, args.rounds)
        _print_throughput(a, args.requests, args.rounds)
    if "c" in args.parts:
        report["qwen3_tokens_per_s"] = c = qwen3_throughput(16, 1)
        _print_qwen3(c)
    if "b" in args.parts:
        report["latency"] = b = latency(args.latency_requests)
        _print_latency(b, args.latency_requests)
    if "d" in args.parts:
        report["ray_backend"] = d = ray_backend(args.requests, args.rounds, args.latency_requests)
        _print_ray(d, args.requests, args.rounds, args.latency_requests)
    report["load_average_1min_after"] = os.getloadavg()[0]
    print(f"1-minute load average after the run: {report['load_average_1min_after']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
