"""Where a shape build's time goes (issue 37): each warm-up shape of an Engine, first and second time.

For the seeded Qwen3-0.6B-shaped checkpoint (dequantized, as the GPU benches load it) and
an engine of ``max_batch``, ``max_len``, ``prefill_chunk``, in one fresh process:

- every shape of ``runner.warm_shapes()`` in its order, timed on first use (wall seconds) and again
  right after (the steady cost), with the number of new files in MLX's PTX cache (kernels NVRTC
  compiled for it);
- for the compiled decode, the first call split into the trace (the compiled function's call,
  which returns lazy outputs) and the evaluation;
- decode step time per padded row count (median of ``--steps``, ms), to price coarser buckets.

Run (MLX CUDA build): ``python bench/gpu_shape_builds.py --out bench/results/gpu_shape_builds.json``;
``--quick`` on CPU (tiny preset, bucketing forced on) as a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from gpu_mixed import load_ours  # noqa: E402
from gpu_throughput import default_ckpt  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig  # noqa: E402


def ptx_files() -> int:
    d = os.environ.get("MLX_PTX_CACHE_DIR")
    if not d or not os.path.isdir(d):
        return -1
    return sum(len(f) for _, _, f in os.walk(d))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - t0


def shapes(engine: Engine) -> list[dict[str, Any]]:
    runner = engine.runner
    names = describe(runner)
    rows = []
    for name, build in zip(names, runner.warm_shapes()):
        before = ptx_files()
        first = timed(build)
        after = ptx_files()
        second = timed(build)
        rows.append({"shape": name, "first_s": round(first, 4), "second_s": round(second, 4),
                     "new_ptx_files": after - before if before >= 0 else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def describe(runner: Any) -> list[str]:
    """Names of ``runner.warm_shapes()`` in order (mirrors its construction)."""
    from mlx_serving.models.generation.model_runner import pow2

    decodes = sorted({min(runner.rows, pow2(k)) for k in range(1, runner.rows + 1)})
    batches = sorted({pow2(k) for k in range(1, runner.rows + 1)})
    widths = runner._widths(runner.max_len)
    names = ["decode b=1"] + [f"prefill b=1 t={t} s=0" for t in widths]
    names += [f"decode b={hi}" for hi in decodes[1:]]
    names += [f"prefill b={b} t={t} s=0" for b in batches[1:] for t in widths]
    start = runner.prefill_chunk
    while start < min(runner.max_len, 4096):
        names += [f"prefill b=1 t={t} s={start}" for t in runner._widths(runner.max_len - start)]
        start += runner.prefill_chunk
    return names


def trace_split(engine: Engine, hi: int) -> dict[str, float]:
    """A fresh compiled decode of ``hi`` rows: trace (call) vs evaluation, then a second call."""
    from mlx_serving.models.decoder.layers import compiled_decode

    r = engine.runner
    fn = compiled_decode(r.state, r._span(1), r.cache, r.decode_backend)
    z = mx.array(np.zeros(hi, dtype=np.int32))
    table = mx.array(np.zeros((hi, r._width(r._table_span(r._span(1)))), dtype=np.int32))
    t0 = time.perf_counter()
    out = fn(r._tokens[:hi, None], z, z, table, r.cache.arrays())
    t1 = time.perf_counter()
    mx.eval(out)
    mx.synchronize()
    t2 = time.perf_counter()
    out = fn(r._tokens[:hi, None], z, z, table, r.cache.arrays())
    mx.eval(out)
    mx.synchronize()
    t3 = time.perf_counter()
    return {"rows": hi, "trace_s": t1 - t0, "eval_s": t2 - t1, "second_s": t3 - t2}


def decode_cost(engine: Engine, steps: int) -> dict[int, float]:
    """Median ms of one warmed decode step per padded row count."""
    r = engine.runner
    out = {}
    for hi in sorted({min(r.rows, 1 << k) for k in range(0, r.rows.bit_length() + 1)}):
        r._warm_decode(hi)
        ts = [timed(lambda: r._warm_decode(hi)) * 1e3 for _ in range(steps)]
        out[hi] = round(statistics.median(ts), 3)
    print(json.dumps({"decode_ms": out}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--ckpt", type=Path, default=None)
    ap.add_argument("--weights", choices=("dequantized", "4bit"), default="dequantized")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_shape_builds.json")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.max_batch, args.max_len, args.prefill_chunk, args.steps = "tiny", 4, 128, 32, 3
    args.ckpt = args.ckpt or default_ckpt(args.preset)
    t0 = time.perf_counter()
    _, _, state = load_ours(args.ckpt, args.preset, args.weights)
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__,
                           "config": {k: str(v) for k, v in vars(args).items()}, "load_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    engine = Engine(state, EngineConfig.of(max_batch=args.max_batch, max_len=args.max_len,
                                           prefill_chunk=args.prefill_chunk, bucket_shapes=True))
    out["engine_s"] = time.perf_counter() - t0
    out["decode_path"] = engine.decode_backend.name
    out["trace_split"] = [trace_split(engine, hi) for hi in (1, args.max_batch)]
    print(json.dumps(out["trace_split"]), flush=True)
    out["shapes"] = shapes(engine)
    out["decode_ms"] = decode_cost(engine, args.steps)
    out["trace_split_after"] = [trace_split(engine, hi) for hi in (2, args.max_batch)]
    engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    total = sum(s["first_s"] for s in out["shapes"])
    print(f"{len(out['shapes'])} shapes, first use {total:.1f} s in all; trace split {out['trace_split']}")


if __name__ == "__main__":
    main()
