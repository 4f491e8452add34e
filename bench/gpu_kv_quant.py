"""Issue 42 on the GPU: the quantized KV cache (int8 / int4) beside the float cache, alternating.

Runs, as fresh processes in alternating rounds (round r: every config in turn), one of two benches
per config on the seeded Qwen3-0.6B-shaped checkpoint (projections dequantized):

- ``--part rows128``: ``bench/gpu_throughput.py --parts curve --concurrency 128 --load-streams 0``
  (128 uniform requests of 128 prompt + 128 new tokens: our Serving, the bare engine, the 4-bit
  Serving), aggregate tok/s = generated tokens / wall seconds (prefill included);
- ``--part arrivals``: ``bench/gpu_arrivals.py --workload chat --fresh`` at ``--rates`` (Poisson
  arrivals from a freshly started serving): goodput, TTFT and ITL percentiles, tok/s, peak memory.

A config is ``DTYPE`` or ``DTYPE:PATH`` (``--kv-cache-dtype`` and ``--decode-path`` of both benches;
e.g. ``auto:matmul`` is the float cache on the path a quantized cache runs on the GPU today, which
separates the cache's cost from the path's). The first ``--warm-rounds`` rounds are run and kept
but left out of the medians (MLX compiles its kernels per shape on a cold machine). Each run is
capped by ``--run-cap-s`` and by what is left of ``--budget-s`` (a device call's limit): a run that
does not fit is recorded as skipped, one cut short or failed with its exit status and log tail.

Writes one JSON (``--out``): every run's bench JSON, each config's medians over its timed runs
and their ratio to the first config's; prints one table. Run (MLX CUDA build):
``python bench/gpu_kv_quant.py --part rows128`` and ``python bench/gpu_kv_quant.py --part arrivals``;
``--quick`` passes ``--quick`` to the benches (tiny preset): a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_serving.models.decoder.decode_backends import DECODE_PATHS  # noqa: E402
from mlx_serving.models.decoder.kv_cache import KV_CACHE_DTYPES  # noqa: E402

__all__ = ["config_args", "medians"]

BENCH = Path(__file__).resolve().parent
#: Per part: the bench and its fixed arguments.
PARTS: dict[str, list[str]] = {
    "rows128": ["gpu_throughput.py", "--parts", "curve", "--concurrency", "128", "--load-streams", "0"],
    "arrivals": ["gpu_arrivals.py", "--workload", "chat", "--fresh", "--search-steps", "0", "--deadline", "20"],
}


def config_args(config: str) -> list[str]:
    """The bench arguments of a config ``DTYPE`` or ``DTYPE:PATH``. Raises ValueError naming
    ``--configs`` for an unknown dtype or path."""
    dtype, _, path = config.partition(":")
    if dtype not in KV_CACHE_DTYPES or (path and path not in DECODE_PATHS):
        raise ValueError(f"--configs: {config!r} is not DTYPE[:PATH] with DTYPE in {list(KV_CACHE_DTYPES)} "
                         f"and PATH in {list(DECODE_PATHS)}")
    return ["--kv-cache-dtype", dtype] + (["--decode-path", path] if path else [])


def figures(part: str, result: dict[str, Any]) -> dict[str, float]:
    """The figures of one run that the medians are taken over (flat names)."""
    if part == "rows128":
        row = result["curve"][max(result["curve"], key=int)]  # the 128-row level (the largest run)
        return {f"{side}_tok_s": row[side]["tok_s"] for side in ("ours", "ours_engine", "ours_4bit") if side in row}
    out: dict[str, float] = {}
    for r in result["runs"]:
        rate = f"{r['rate']:g}"
        out |= {f"r{rate}_goodput": r["goodput"], f"r{rate}_ttft_p50_ms": r["ttft_ms"]["p50"],
                f"r{rate}_ttft_p99_ms": r["ttft_ms"]["p99"], f"r{rate}_itl_p50_ms": r["itl_ms"]["p50"],
                f"r{rate}_itl_p99_ms": r["itl_ms"]["p99"], f"r{rate}_tok_s": r["tok_s"],
                f"r{rate}_peak_gb": r["peak_memory_bytes"] / 1e9}
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per figure, the median over ``runs`` (each a ``{"figures": {...}}``) that have it."""
    names = sorted({k for r in runs for k in r["figures"]})
    return {k: statistics.median(r["figures"][k] for r in runs if k in r["figures"]) for k in names}


def run_one(part: str, config: str, rnd: int, args: argparse.Namespace, left_s: float) -> dict[str, Any]:
    """One bench process for ``config`` in round ``rnd``, capped at ``--run-cap-s`` and ``left_s``."""
    cap = min(args.run_cap_s, left_s)
    row: dict[str, Any] = {"config": config, "round": rnd, "warm": rnd < args.warm_rounds}
    if cap < args.min_run_s:
        return row | {"status": "skipped", "cap_s": cap}
    stem = args.work / f"{part}_{config.replace(':', '_')}_r{rnd}"
    bench, *fixed = PARTS[part]
    cmd = [sys.executable, str(BENCH / bench), *fixed, *config_args(config), "--out", f"{stem}.json",
           *args.bench_args]
    t0 = time.perf_counter()
    status = run_capped(cmd, Path(f"{stem}.log"), cap)
    row |= {"status": status, "wall_s": time.perf_counter() - t0, "command": " ".join(cmd[1:])}
    print(f"== {part} {config} round {rnd}: {status} in {row['wall_s']:.0f} s", flush=True)
    if status != 0:
        tail = Path(f"{stem}.log").read_text(errors="replace")[-2000:]
        print(tail, flush=True)
        return row | {"tail": tail}
    result = json.loads(Path(f"{stem}.json").read_text())
    return row | {"figures": figures(part, result), "result": result}


def run_capped(cmd: list[str], log: Path, cap_s: float) -> int | str:
    """Run ``cmd`` in its own process group, output into ``log``; its exit status, or "timeout"
    when it ran past ``cap_s`` seconds (then its whole group is killed)."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def summarize(part: str, configs: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each config's medians over its timed runs, and their ratios to the first config's."""
    meds = {c: medians([r for r in runs if r["config"] == c and not r["warm"] and "figures" in r]) for c in configs}
    base = meds[configs[0]]
    ratios = {c: {k: v / base[k] for k, v in m.items() if base.get(k)} for c, m in meds.items()}
    return {"part": part, "baseline": configs[0], "medians": meds, "ratio_to_baseline": ratios}


def print_table(summary: dict[str, Any]) -> None:
    """One line per config (per config and rate for arrivals): its medians, the ratio to the
    baseline's in brackets."""
    ratios = summary["ratio_to_baseline"]
    for config, med in summary["medians"].items():
        groups: dict[str, list[str]] = {}
        for k, v in med.items():
            group, name = k.split("_", 1) if summary["part"] == "arrivals" else ("", k)
            groups.setdefault(group, []).append(f"{name} {v:.4g} ({ratios[config].get(k, float('nan')):.2f}x)")
        for group, cells in groups.items():
            print(f"{config:<14}{group:<6}" + "; ".join(cells))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=sorted(PARTS), required=True)
    ap.add_argument("--configs", default="auto,int8,int4", help="DTYPE or DTYPE:PATH, comma-separated; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in all, warm ones included")
    ap.add_argument("--warm-rounds", type=int, default=1, help="first rounds left out of the medians")
    ap.add_argument("--rates", default="16,32", help="arrivals: requests/s")
    ap.add_argument("--duration", type=float, default=10.0, help="arrivals: seconds per rate")
    ap.add_argument("--budget-s", type=float, default=540.0, help="all runs together, seconds")
    ap.add_argument("--run-cap-s", type=float, default=240.0, help="one run, seconds")
    ap.add_argument("--min-run-s", type=float, default=30.0, help="a run is not started with less left than this")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_kv_quant"), help="where each run's JSON goes")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/gpu_kv_quant_<part>.json")
    ap.add_argument("--quick", action="store_true", help="the benches' --quick (tiny preset): a CPU smoke run")
    args = ap.parse_args()
    args.out = args.out or Path(f"bench/results/gpu_kv_quant_{args.part}.json")
    args.bench_args = ["--quick"] if args.quick else []
    if args.part == "arrivals" and not args.quick:
        args.bench_args += ["--rates", args.rates, "--duration", str(args.duration)]
    return args


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    configs = args.configs.split(",")
    for c in configs:
        config_args(c)  # a bad config fails before any run
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {"command": " ".join(["python", "bench/gpu_kv_quant.py", *sys.argv[1:]]),
                           "configs": configs, "runs": runs}
    for rnd in range(args.rounds):
        for config in configs:
            runs.append(run_one(args.part, config, rnd, args, args.budget_s - (time.perf_counter() - t0)))
            out |= summarize(args.part, configs, runs)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2))
    print_table(out)


if __name__ == "__main__":
    main()
