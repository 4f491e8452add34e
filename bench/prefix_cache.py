"""Prefix caching on the paged KV cache vs off (issue 13; the slot-design regimes went with the slot
cache in issue 26: their results stay in docs/benchmarks.md).

Workload: ``--requests`` (32) greedy requests sharing a ``--system`` (1,024) token system prompt,
each followed by its own ``--question`` (32) random tokens, ``--max-new`` (16) new tokens each (EOS
ignored), request ``i`` added to the engine at step ``i * --arrival-steps`` (default 1: one new
request per engine step, so later requests find the system prompt's blocks computed). Engine:
``max_batch`` = requests, ``prefill_chunk`` 512, ``max_len`` = system + question + max_new rounded
up to 16. Regimes, each in a fresh subprocess (peak RSS per regime):

- ``on``: the paged engine (models/generation), prefix caching on, default KV budget;
- ``off``: the same with ``prefix_caching=False``.

Metrics: TTFT p50/p99 (``Engine.add`` -> first token on the host, the events' ``elapsed_ms``);
aggregate throughput = generated tokens / (last token - first add) and prompt + generated tokens /
the same; peak RSS of the process (``ru_maxrss``; includes weights and MLX); KV bytes reserved;
``kv_stats`` of the paged runs. Checkpoint: ``--preset`` tiny (4-bit, seed 0, written to a temp
dir) or 0.6b (``seeded_checkpoint("seeded:qwen3-0.6b")``, the 335 MB seeded-random 0.6B checkpoint), or ``--ckpt``
(a checkpoint of that preset, e.g. the benches' /tmp/qwen3-0.6b-bench). Each engine runs
``Engine.warm_up()`` (as the serving does; a no-op on the CPU) before the timed workload, so
first-use kernel builds and compiled-decode traces are not counted in TTFT.

With ``on`` and ``off`` both run, ``summary`` has issue 17's GPU target (128 requests sharing a
2,048-token system prompt: TTFT p50 with caching <= 0.25x without) as ``targets.ttft_p50_on_over_off``
with value, target and met (the issue's workload: ``--requests 128 --system 2048``).

Run: ``.venv/bin/python bench/prefix_cache.py [--preset tiny|0.6b] [--regimes on,off]`` (writes
bench/results/prefix_cache_<preset>.json, or ..._<preset>_<regimes joined by +>.json for other regimes,
or ``--out``). ``--quick``: tiny preset, 8 requests, 256-token system prompt, 4 new tokens,
regimes on and off: a CPU smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_summary import PREFIX_RATIO  # noqa: E402  (issue 17: TTFT p50 with caching <= 0.25x without)


def worker(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    from mlx_serving.models.generation import Engine, EngineConfig
    from mlx_serving.models.generation import SamplingParams
    from mlx_serving.models.loader import load

    t_load = time.perf_counter()
    state = load(args.checkpoint)
    load_s = time.perf_counter() - t_load
    rng = np.random.default_rng(0)
    system = rng.integers(0, 150000, args.system).tolist()
    prompts = [system + rng.integers(0, 150000, args.question).tolist() for _ in range(args.requests)]
    max_len = args.max_len or -(-(args.system + args.question + args.max_new) // 16) * 16
    kw = dict(max_batch=args.requests, max_len=max_len, prefill_chunk=512)
    engine = Engine(state, EngineConfig.of(prefix_caching=args.worker == "on", **kw))
    kv_bytes = engine.cache.nbytes
    t_warm = time.perf_counter()
    engine.warm_up()
    warm_s = time.perf_counter() - t_warm
    params = SamplingParams(max_new_tokens=args.max_new)
    first: dict[int, float] = {}
    generated = 0
    t0 = time.perf_counter()
    step = 0
    added = 0
    while added < len(prompts) or engine.num_active:
        while added < len(prompts) and added * args.arrival_steps <= step:
            engine.add(added, prompts[added], params)
            added += 1
        for ev in engine.step():
            first.setdefault(ev.seq_id, ev.elapsed_ms)
            generated += 1
        step += 1
    wall = time.perf_counter() - t0
    ttft = np.array([first[i] for i in range(len(prompts))])
    stats = engine.kv_stats()
    return {
        "regime": args.worker, "load_s": round(load_s, 2), "warm_up_s": round(warm_s, 2), "steps": step, "wall_s": round(wall, 3),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1), "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "gen_tok_per_s": round(generated / wall, 1),
        "total_tok_per_s": round((generated + sum(map(len, prompts))) / wall, 1),
        "generated": generated, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "kv_reserved_mb": round(kv_bytes / 2**20, 1),
        "kv_stats": dataclasses.asdict(stats) if stats is not None else None,
        "device": str(mx.default_device()), "dtype": str(state.dtype),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "0.6b"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--arrival-steps", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=0, help="engine max_len (default: the workload's, rounded up to 16)")
    ap.add_argument("--regimes", default="on,off")
    ap.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (default: per --preset, see above)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/prefix_cache_<preset>...)")
    ap.add_argument("--quick", action="store_true", help="tiny, 8 requests, 256-token system prompt: a CPU smoke run")
    ap.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.preset, args.requests, args.system, args.question, args.max_new = "tiny", 8, 256, 16, 4
        args.regimes = "on,off"
    if args.worker:
        print(json.dumps(worker(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt is not None:
            ckpt = args.ckpt
        elif args.preset == "tiny":
            from mlx_serving.models.seeded_checkpoint import write_checkpoint
            ckpt = write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        else:
            from mlx_serving.models.sources import seeded_checkpoint
            ckpt = seeded_checkpoint("seeded:qwen3-0.6b")
        results = []
        for regime in args.regimes.split(","):
            cmd = [sys.executable, __file__, "--worker", regime, "--checkpoint", str(ckpt)]
            cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                    ("preset", "requests", "system", "question", "max_new", "arrival_steps", "max_len")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"regime {regime} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
            out = proc.stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    by = {r["regime"]: r for r in results}
    summary = {}
    if "on" in by and "off" in by:
        summary["ttft_p50_off_over_on"] = round(by["off"]["ttft_ms_p50"] / by["on"]["ttft_ms_p50"], 2)
        summary["throughput_on_over_off"] = round(by["on"]["gen_tok_per_s"] / by["off"]["gen_tok_per_s"], 2)
        ratio = by["on"]["ttft_ms_p50"] / by["off"]["ttft_ms_p50"]
        summary["targets"] = {"ttft_p50_on_over_off": {"value": round(ratio, 4), "target": PREFIX_RATIO,
                                                       "met": ratio <= PREFIX_RATIO}}
    doc = {"command": " ".join(["python", "bench/prefix_cache.py"] + sys.argv[1:]),
           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version()},
           "results": results, "summary": summary}
    suffix = "" if args.regimes == "on,off" else "_" + args.regimes.replace(",", "+")
    path = args.out or ROOT / "bench" / "results" / f"prefix_cache_{args.preset}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
