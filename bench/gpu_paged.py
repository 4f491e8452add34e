"""GPU: the device-only paged decode step by rows and context position, against the floor.

The bare compiled decode forward (no engine) of ``B`` rows at position ``pos`` over the paged KV
cache (dequantized projections, the CUDA default; split-K on, the default heuristic, and off),
median of 30 synchronous steps, against the physical floor: (weight bytes + live KV bytes) /
measured copy bandwidth (issue 17). The slot cache this script once compared the paged one with
went in issue 26; those results stay in docs/benchmarks.md.

Run (MLX CUDA build): ``python bench/gpu_paged.py --context 1,32,128,256:200,800,1500 --out
bench/results/gpu_context.json``; ``--quick`` for a CPU smoke run (tiny preset).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_summary import step_floor_ms  # noqa: E402
from mlx_serving.models.decoder.kv_cache import init_paged_kv_cache, kv_bytes_per_token, row_blocks  # noqa: E402
from mlx_serving.models.loader import load  # noqa: E402
from mlx_serving.models.seeded_checkpoint import write_checkpoint  # noqa: E402
from mlx_serving.models.decoder.layers import compiled_decode  # noqa: E402
from mlx_serving.models.decoder import cuda_kernels as kernels  # noqa: E402
from mlx_serving.models.decoder.decode_backends import decode_backend  # noqa: E402


def device_step_ms(state: Any, b: int, pos: int, iters: int = 30) -> float:
    """Median ms of one synchronous compiled decode forward of ``b`` rows at position ``pos``
    (no engine: the device time of the step plus its launch) over the paged cache."""
    table = row_blocks(b, pos + 16)
    cache = init_paged_kv_cache(state, table.size)
    fn = compiled_decode(state, 0, cache, decode_backend(state))
    args = [mx.zeros((b, 1), dtype=mx.int32), mx.full((b,), pos, dtype=mx.int32), mx.ones((b,), dtype=mx.int32),
            mx.array(table)]
    arrays = cache.arrays()
    times = []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        logits, arrays = fn(*args, arrays)
        mx.eval(logits, arrays)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def copy_bandwidth_gbs(nbytes: int = 1 << 32) -> float:
    """Measured device copy bandwidth, GB/s: bytes read + written by ``y = x + 0`` over a
    ``nbytes`` array (median of 5)."""
    x = mx.zeros((nbytes // 2 // 1024, 1024), dtype=mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        mx.eval(x + 0)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def context_study(state: Any, batches: list[int], positions: list[int], copy_bytes: int) -> list[dict[str, Any]]:
    """Device-only paged decode step (ms) by rows and context position, split-K on (the default
    heuristic) and off, against the floor: (weight bytes + live KV bytes) / copy bandwidth."""
    from gpu_step import step_weight_bytes  # gpu_step imports this module at its top

    weights = step_weight_bytes(state)  # each buffer once (no weight_t views), no embedding table
    kv_per_token = kv_bytes_per_token(state)
    bw = copy_bandwidth_gbs(copy_bytes)
    rows = []
    one = kernels.split_count
    for b in batches:
        for pos in positions:
            floor_ms = step_floor_ms(weights, kv_per_token, b * (pos + 1), bw)
            split = device_step_ms(state, b, pos)
            kernels.split_count = lambda r, h: 1
            try:
                unsplit = device_step_ms(state, b, pos)
            finally:
                kernels.split_count = one
            rows.append({"batch": b, "pos": pos, "split_k_ms": split, "one_split_ms": unsplit,
                         "floor_ms": floor_ms, "split_k_over_floor": split / floor_ms, "copy_gbs": bw})
            print(f"B={b:4d} pos={pos:5d}  split-K {split:6.2f} ms  one split {unsplit:6.2f} ms  "
                  f"floor {floor_ms:5.2f} ms  ({split / floor_ms:.2f}x floor)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen3-0.6b-bench"))
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_context.json"))
    ap.add_argument("--quick", action="store_true", help="tiny preset, two points: a CPU smoke run")
    ap.add_argument("--copy-bytes", type=int, default=1 << 32, help="array size of the bandwidth probe")
    ap.add_argument("--context", default="1,32,128,256:200,800,1500", help="ROWS,...:POS,...")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.context = "tiny", "1,4:32"
        args.ckpt, args.copy_bytes = Path("/tmp/qwen3-tiny-bench"), 1 << 26
    if not (args.ckpt / "config.json").is_file():
        write_checkpoint(args.ckpt, args.preset, seed=0)
    state = load(args.ckpt, dequantize=True)
    batches, positions = ([int(x) for x in part.split(",")] for part in args.context.split(":"))
    out: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__, "preset": args.preset,
                           "decode_path": decode_backend(state).name,
                           "context": context_study(state, batches, positions, args.copy_bytes)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
