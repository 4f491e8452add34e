"""GPU decode-step profile: our forward() vs a plain decode loop over mlx-lm's Qwen3 module.

One process, one seeded Qwen3-0.6B-shaped 4-bit checkpoint (as bench/gpu_throughput.py). Times
(ms, ``mx.eval`` after every call, so host graph building is included):

- ``decode``: one decode step at B = 1, 8, 32, 128 rows, attention span ``--kv``, for our
  masked one-token attention through plain matmuls (``matmul``, the default), through
  ``mx.fast.scaled_dot_product_attention`` with the boolean mask (``sdpa``), with no mask at all
  (``nomask``: wrong for ragged rows, the kernel floor), and mlx-lm's module with its own cache;
  ``first_ms`` is the first call at that shape, ``step_ms`` the median of the next ``--steps``;
- ``new_shape``: first-call cost of a new span / a new batch for each variant;
- ``cache_slots``: one decode step at B = 8 over a cache of 8 vs 256 slots (a step that copied
  the cache instead of writing it in place would grow with the slots);
- ``prefill``: first and second call of a B-row, 128-token prefill;
- ``engine``: whole Engine runs (N sequences, 128-token prompts): wall, tok/s, step median.

Its forward-step variants are the generic decode path (``GenericDecode``: "matmul" / "sdpa"); the
fused CUDA path is studied by bench/gpu_step.py.

Run (MLX CUDA build): ``python bench/gpu_profile.py``; JSON to bench/results/gpu_profile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_serving.models.generation import Engine, SamplingParams  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.generation.decode_backends import GenericDecode  # noqa: E402
from mlx_serving.models.generation.slot_cache import init_kv_cache  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.models.generation.attention import Rows
from mlx_serving.models.layers import forward  # noqa: E402


def clock(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t0) * 1e3


def measure(fn: Callable[[], Any], steps: int) -> dict[str, float]:
    first = clock(fn)
    clock(fn)
    return {"first_ms": first, "step_ms": statistics.median(clock(fn) for _ in range(steps))}


def ours_step(state: Any, cache: Any, b: int, kv: int, variant: str) -> Callable[[], Any]:
    tokens = mx.array(np.arange(b, dtype=np.int32)[:, None] + 100)
    rows = Rows(tokens, None, mx.full((b,), kv - 1, dtype=mx.int32), mx.ones((b,), dtype=mx.int32), kv,
                mx.zeros((b,), dtype=mx.int32), dense=b == 1 or variant == "nomask")

    decode = GenericDecode(sdpa=variant == "sdpa")  # the generic path's variants

    def run() -> list[mx.array]:
        return [forward(state, cache, rows, decode), *cache.keys, *cache.values]
    return run


def mlxlm_step(model: Any, b: int, kv: int) -> Callable[[], Any]:
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(np.full((b, kv - 1), 100, dtype=np.int32)), cache=cache))
    tok = mx.full((b, 1), 7, dtype=mx.int32)

    def run() -> mx.array:
        for c in cache:  # stay at span kv: rewind the one token each step appends
            c.offset = kv - 1
        return model(tok, cache=cache)
    return run


def engine_run(state: Any, n: int, prompt_len: int, new: int, **kw: Any) -> dict[str, float]:
    eng = Engine(state, max_batch=n, max_len=prompt_len + new + 8, **kw)
    rng = np.random.default_rng(n)
    for i in range(n):
        eng.add(i, rng.integers(100, 5000, prompt_len).tolist(), SamplingParams(max_new_tokens=new))
    stamps, count = [time.perf_counter()], 0
    while eng.num_active:
        count += len(eng.step())
        stamps.append(time.perf_counter())
    gaps = np.diff(stamps) * 1e3
    return {"wall_s": stamps[-1] - stamps[0], "tok_s": count / (stamps[-1] - stamps[0]),
            "step_ms_median": float(np.median(gaps)), "steps": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-0.6b-bench"))
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--engine", default="8,32,128")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_profile.json"))
    args = ap.parse_args()
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    from mlx_lm import load as mlxlm_load
    state = load(args.ckpt)
    model, _ = mlxlm_load(str(args.ckpt))
    batches = [int(x) for x in args.batches.split(",")]
    out: dict[str, Any] = {"mlx": mx.__version__, "device": str(mx.default_device()), "kv": args.kv}
    cache = init_kv_cache(state, 512, max(batches))
    variants = ("matmul", "sdpa", "nomask")
    out["decode"] = {v: {b: measure(ours_step(state, cache, b, args.kv, v), args.steps) for b in batches}
                     for v in variants}
    out["decode"]["mlx_lm"] = {b: measure(mlxlm_step(model, b, args.kv), args.steps) for b in batches}
    print(json.dumps(out["decode"]), flush=True)
    out["new_shape"] = {v: {"span+44 at B=8": clock(ours_step(state, cache, 8, args.kv + 44, v)),
                            "B=12": clock(ours_step(state, cache, 12, args.kv, v))} for v in variants}
    big = init_kv_cache(state, 512, 256)
    small = init_kv_cache(state, 512, 8)
    out["cache_slots"] = {s: measure(ours_step(state, c, 8, args.kv, "matmul"), args.steps)
                          for s, c in (("8", small), ("256", big))}
    del big, small
    print(json.dumps({k: out[k] for k in ("new_shape", "cache_slots")}), flush=True)
    out["prefill"] = {}
    for b in (8, 16):
        rows = Rows(mx.array(np.full((b, 128), 100, dtype=np.int32)), mx.arange(b, dtype=mx.int32),
                    mx.zeros((b,), dtype=mx.int32), mx.full((b,), 128, dtype=mx.int32), 256,
                    mx.full((b,), 127, dtype=mx.int32))
        out["prefill"][b] = measure(lambda: [forward(state, cache, rows), *cache.keys], 3)
    del cache
    out["engine"] = {}
    for n in (int(x) for x in args.engine.split(",")):
        engine_run(state, n, 128, 32)  # warm-up at this size
        out["engine"][n] = engine_run(state, n, 128, 128)
        print(n, out["engine"][n], flush=True)
    engine_run(state, 128, 128, 32, compile_decode=True)
    out["engine"]["128 compile_decode"] = engine_run(state, 128, 128, 128, compile_decode=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
