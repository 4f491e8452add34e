"""GPU start-up and Serving overhead at library defaults (issue 26 targets).

Each start-up run is a fresh process (``--child``): import, ``load`` the seeded Qwen3-0.6B-shaped
4-bit checkpoint (the benches' /tmp/qwen3-0.6b-bench), build ``text_generation.serving`` with the
library defaults (max_batch 32, max_len 2,048, prefill_chunk 512), ``Serving.start`` it and stream
one 128-token request (16 new tokens). Recorded, in seconds from the process's start (the parent's
spawn time): ``load_s``, ``started_s`` (``Serving.start`` returned: the essential shapes built),
``first_token_s`` (load -> first token = first_token_s - import_s); the first request's TTFT after
start and a second request's; device memory in use (``nvidia-smi``, GPU 0) against weights (MLX's active
memory after ``load``) + KV budget + 2 GB, once after the first request and once after the idle-time warm-up ended. Run 1
uses an empty ``MLX_PTX_CACHE_DIR`` and ``MLX_SERVING_CACHE`` (NVRTC compiles everything: MLX's
kernels and the decode kernels' cubins), run 2 the caches run 1 left.

Then, in this process: the Serving vs the bare engine at 128 uniform requests (128-token prompts,
128 new tokens, EOS ignored; gpu_throughput.py's ``serving_concurrent`` / ``engine_concurrent``),
alternating, 3 runs each, median tok/s (target >= 0.95x); the engine with the serving's GPU step
budget (``GPU_STEP_TOKENS``). ``--peer``: then mlx-lm's ``batch_generate`` on the same prompts
(the checkpoint as stored, batch sizes = the concurrency), one warm-up and one timed run.

Run (MLX CUDA build): ``python bench/gpu_startup.py --out bench/results/gpu_startup.json``;
``--quick`` on CPU (tiny preset, 8 requests) as a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def gpu_memory_mb() -> float | None:
    """MB in use on GPU 0 (``nvidia-smi``), None without it. The start-up child is the only process
    holding GPU memory: the parent writes the checkpoint in a process of its own and imports no MLX
    until the start-ups are over."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.strip().splitlines()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def child(args: argparse.Namespace) -> dict[str, Any]:
    t_spawn = args.spawn
    import mlx.core as mx

    from mlx_serving.models import text_generation
    from mlx_serving.models.decoder.kv_cache import kv_bytes_per_token
    from mlx_serving.models.loader import load
    from mlx_serving.serving import Serving
    from mlx_serving.tokenization import Tokenizer

    out: dict[str, Any] = {"import_s": time.time() - t_spawn, "graph_cache": os.environ.get("MLX_CUDA_GRAPH_CACHE_SIZE")}
    mx.eval(mx.zeros((1,)))
    out["memory_context_mb"] = gpu_memory_mb()  # the CUDA context alone
    out["device_info"] = {k: str(v) for k, v in mx.device_info().items()} if hasattr(mx, "device_info") else None
    from mlx_serving.models.decoder.cuda_kernels import sm_count
    out["sm_count"] = sm_count()
    state = load(args.ckpt)
    mx.eval(state.embed_tokens.weight)
    out["load_s"] = time.time() - t_spawn
    weights = mx.get_active_memory()  # the loaded model: nothing else is allocated yet
    gen = text_generation.serving(Tokenizer.from_dir(args.ckpt), state, max_new_tokens=16, **args.options)
    out["memory_after_load_mb"] = gpu_memory_mb()
    with Serving.start(gen) as h:
        out["started_s"] = time.time() - t_spawn
        out["memory_after_start_mb"] = gpu_memory_mb()
        for name in ("first", "second"):
            t0 = time.time()
            with h.stream({"text": "hello " * 120, "max_new_tokens": 16}) as stream:
                for i, _ in enumerate(stream):
                    if i == 0:
                        out[f"{name}_ttft_ms"] = (time.time() - t0) * 1e3
                        out.setdefault("first_token_s", time.time() - t_spawn)
        kv = h.stats().backend.get("blocks_total", 0) * 16 * kv_bytes_per_token(state)
        out["memory_after_first_mb"] = gpu_memory_mb()
        deadline = time.time() + args.idle_wait
        while time.time() < deadline and h.stats().backend.get("warm_shapes_left", 0) > 0:
            time.sleep(0.5)
        out["warm_shapes_left"] = h.stats().backend.get("warm_shapes_left")
        out["idle_warm_done_s"] = time.time() - t_spawn
        out["memory_after_warm_mb"] = gpu_memory_mb()
        out["mlx_active_mb"], out["mlx_cache_mb"] = mx.get_active_memory() / 2**20, mx.get_cache_memory() / 2**20
    out["weights_mb"], out["kv_budget_mb"] = weights / 2**20, kv / 2**20
    out["memory_bound_mb"] = out["weights_mb"] + out["kv_budget_mb"] + 2048
    out["load_to_first_token_s"] = out["first_token_s"] - out["import_s"]
    return out


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import mlx.core as mx
    import tokenizers
    from gpu_throughput import engine_concurrent, serving_concurrent, word_prompts

    from mlx_serving.models import text_generation
    from mlx_serving.models.generation import Engine, EngineConfig
    from mlx_serving.models.loader import load
    from mlx_serving.models.text_generation._options import GPU_STEP_TOKENS
    from mlx_serving.serving import Serving
    from mlx_serving.tokenization import Tokenizer

    raw = tokenizers.Tokenizer.from_file(str(args.ckpt / "tokenizer.json"))
    tok = Tokenizer(raw, eos_token_ids=())
    state = load(args.ckpt)
    n, new = args.concurrency, args.new
    prompts = word_prompts(raw, 2 * n, 128, seed=0)
    texts = [raw.decode(p) for p in prompts]
    max_len = 128 + new + 8
    gen = text_generation.serving(tok, state, max_new_tokens=new, max_len=max_len, max_batch=n)
    runs: dict[str, list[float]] = {"serving": [], "engine": []}
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    eng = Engine(state, EngineConfig.of(max_batch=n, max_len=max_len,
                                        max_step_tokens=GPU_STEP_TOKENS))  # the serving's budget
    eng.warm_up()
    engine_concurrent(eng, prompts[n:], new)
    with Serving.start(gen) as h:
        anyio.run(serving_concurrent, h, texts[n:])
        for _ in range(args.repeats):
            runs["serving"].append(anyio.run(serving_concurrent, h, texts[:n])["tok_s"])
            runs["engine"].append(engine_concurrent(eng, prompts[:n], new)["tok_s"])
    eng.close()
    mx.clear_cache()
    if args.peer:  # mlx-lm's batch_generate on the same prompts, as stored (4-bit), every prompt at once
        from gpu_throughput import mlxlm_batch
        from mlx_lm import load as mlxlm_load

        model, mlxlm_tok = mlxlm_load(str(args.ckpt))
        mlxlm_tok.eos_token_ids = set()
        kw = {"completion_batch_size": n, "prefill_batch_size": n}
        mlxlm_batch(model, mlxlm_tok, prompts[n:], new, **kw)  # warm-up
        runs["mlx_lm_batch_generate"] = [mlxlm_batch(model, mlxlm_tok, prompts[:n], new, **kw)["tok_s"]]
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {"serving_over_engine": med["serving"] / med["engine"]}
    if args.peer:
        ratios["serving_over_batch_generate"] = med["serving"] / med["mlx_lm_batch_generate"]
    return {"concurrency": n, "new": new, "switch_interval_s": sys.getswitchinterval(), "runs_tok_s": runs,
            "median_tok_s": med, **ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-0.6b-bench"))
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_startup.json")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-wait", type=float, default=90.0, help="most seconds to wait for the idle warm-up")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peer", action="store_true",
                    help="overhead: also mlx-lm's batch_generate (completion and prefill batch = --concurrency)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="overhead: sys.setswitchinterval (seconds) before the runs (default: as is, 5 ms)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spawn", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="startup,overhead", help="comma-separated: startup, overhead")
    ap.add_argument("--graph-caches", type=int, nargs="*", default=[],
                    help="more warm start-ups, each with MLX_CUDA_GRAPH_CACHE_SIZE set to this (MLX's default: 400)")
    args = ap.parse_args()
    args.options = {}
    if args.quick:
        args.preset, args.ckpt, args.concurrency, args.new, args.repeats = "tiny", Path("/tmp/qwen3-tiny-bench"), 8, 8, 1
        args.options, args.idle_wait = {"max_len": 256}, 5.0
    if args.child:
        print(json.dumps(child(args)))
        return
    if not (args.ckpt / "config.json").is_file():  # in a process of its own: this one holds no GPU memory
        subprocess.run([sys.executable, "-c", "import sys; from mlx_serving.models.seeded_checkpoint import "
                        "write_checkpoint as w; w(sys.argv[1], sys.argv[2], seed=0)", str(args.ckpt), args.preset],
                       check=True, timeout=900)
    out: dict[str, Any] = {"command": " ".join(["python", "bench/gpu_startup.py", *sys.argv[1:]]), "runs": []}
    ptx = tempfile.mkdtemp(prefix="ptx-")  # MLX's kernel cache and ours (the decode cubins), empty for run 1
    env = {**os.environ, "MLX_PTX_CACHE_DIR": ptx, "MLX_SERVING_CACHE": tempfile.mkdtemp(prefix="mlxs-cache-")}
    runs = [("cold_ptx_cache", None), ("warm_ptx_cache", None)] + [(f"warm_ptx_cache_graphs_{g}", g) for g in args.graph_caches]
    for run, graphs in runs if "startup" in args.parts else ():
        env = {**env, "MLX_CUDA_GRAPH_CACHE_SIZE": str(graphs)} if graphs else env
        cmd = [sys.executable, __file__, "--child", "--ckpt", str(args.ckpt), "--spawn", str(time.time()),
               "--idle-wait", str(args.idle_wait)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode:
            out["runs"].append({"run": run, "error": proc.stderr[-3000:]})
        else:
            out["runs"].append({"run": run, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(json.dumps(out["runs"][-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    if "overhead" in args.parts:
        out["serving_vs_engine"] = overhead(args)
        print(json.dumps(out["serving_vs_engine"]), flush=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
