"""Issue 37: the decode kernels launched as cached cubins (``mx.fast.precompiled_cuda_kernel``,
shape-free) vs the same contracts through ``mx.fast.cuda_kernel`` (as at 5507cc4: one build per
template, sizes as templates), in one process: decode step time per row count and the bare engine
at 128 uniform requests; and the host cost of one launch against the size of the launched binary.
Needs ``bench/_old_cuda_kernels.py`` (``git show 5507cc4:src/mlx_serving/models/generation/cuda_kernels.py``).
Run (MLX CUDA build): ``python bench/gpu_kernel_ab.py --out bench/results/gpu_kernel_ab.json``."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

import mlx.core as mx  # noqa: E402

import _old_cuda_kernels as old  # noqa: E402
from gpu_mixed import load_ours  # noqa: E402
from gpu_throughput import default_ckpt, engine_concurrent, word_prompts  # noqa: E402
from mlx_serving.models.decoder import cuda_kernels as new  # noqa: E402
from mlx_serving.models.generation import Engine, EngineConfig  # noqa: E402
from mlx_serving.models.decoder.decode_backends import FusedDecode  # noqa: E402


def backend(mod) -> FusedDecode:
    return FusedDecode(attention=mod.decode_attention, add_rms_norm=mod.add_rms_norm, swiglu=mod.swiglu)


def step_ms(engine: Engine, hi: int, n: int) -> float:
    r = engine.runner
    r._warm_decode(hi)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        r._warm_decode(hi)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def launch_us(fn, n: int = 400) -> float:
    """Host+device time of one tiny launch, evaluated one at a time (median us)."""
    mx.eval(fn())
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_kernel_ab.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    raw, _, state = load_ours(default_ckpt("0.6b"), "0.6b", "dequantized")
    prompts = word_prompts(raw, 256, 128, seed=0)
    out: dict = {"steps_ms": {}, "engine_tok_s": {"old": [], "new": []}}
    engines = {}
    for name, mod in (("old", old), ("new", new)):
        t0 = time.perf_counter()
        engines[name] = e = Engine(state, EngineConfig.of(max_batch=128, max_len=264, decode_path=backend(mod)))
        e.warm_up()
        out[f"warm_up_s_{name}"] = time.perf_counter() - t0
        engine_concurrent(e, prompts[128:], 128)
    for _ in range(args.rounds):  # alternating
        for name, e in engines.items():
            out["engine_tok_s"][name].append(engine_concurrent(e, prompts[:128], 128)["tok_s"])
    for name, e in engines.items():
        out["steps_ms"][name] = {hi: step_ms(e, hi, 30) for hi in (1, 8, 32, 128)}
    x = mx.random.normal((1, 2 * 3072)).astype(mx.bfloat16)
    h, w = mx.random.normal((1, 1024)).astype(mx.bfloat16), mx.ones((1024,), dtype=mx.bfloat16)
    out["launch_us"] = {"old_swiglu": launch_us(lambda: old.swiglu(x)), "new_swiglu": launch_us(lambda: new.swiglu(x)),
                        "old_add_rms_norm": launch_us(lambda: old.add_rms_norm(h, h, w, 1e-6)[0]),
                        "new_add_rms_norm": launch_us(lambda: new.add_rms_norm(h, h, w, 1e-6)[0]),
                        "mlx_add": launch_us(lambda: h + h)}
    out["engine_median"] = {k: statistics.median(v) for k, v in out["engine_tok_s"].items()}
    print(json.dumps(out, indent=1))
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
