"""The native CPU kernel (models/native) beside MLX's own ``mx.quantized_matmul`` on SmolLM2's
layer shapes (issue 24): milliseconds and GFLOP/s per product, medians of ``--repeats`` calls,
alternating the two kernels, and the largest difference between their outputs.

    .venv/bin/python bench/cpu_kernels.py            # JSON to bench/results/cpu_kernels.json

Shapes (rows x out x in, bits, group size): one row (decode) and 8, 32 and 512 rows (batched
decode, prefill) through SmolLM2-135M's q/k/v (960 x 576), gate/up (3072 x 576), down (576 x
1536) and tied head (49,152 x 576, 8 bits), all group size 32 as its GGUF's Q4_1 / Q8_0 convert.
FLOPs = 2 x rows x out x in. Threads: OpenMP's default (the cores), ``OMP_NUM_THREADS`` to set.

Beside them the int8-activation product of the CPU decode step (models/decoder/cpu/qdot.cpp,
issue 39: activations rounded to int8 per block of 32, integer dot products, AVX-512 VNNI / AVX2 /
portable) on one thread (``int8_ms``, the rounding and the output copy included), and its largest
difference from the float product relative to the output's largest value (``int8_rel_diff``).
``--rows 1`` times the decode shapes only.

``--gemm-only``: the int8 GEMM alone, a row per M (1, 2, 3, 4, 5, 8, 16, 24, 32, 40, 64, 512: ``--gemm-rows``;
2-40 rows are speculative verify steps, issue 41) and
shape, GMAC/s (rows x out x in multiply-accumulates per second) on the pool's threads. Where the
module has ``int8_packed_matmul`` (issue 39: the weights packed once, when the QMatrix is made) it
times that (``kernel: packed``); an older build's module has only ``int8_quantized_matmul``, whose
weight panels were unpacked on every call (``kernel: unpacked per call``): run the same file with
``PYTHONPATH`` at the older tree's ``src`` for the before figures, alternating the two, same sitting.

And the int8 GEMM of the native prefill (models/decoder/cpu/qgemm.cpp through the
``int8_quantized_matmul`` primitive, issue 39: the same products as the decode step's, each weight
panel unpacked once for all the rows) on the pool's threads (``OMP_NUM_THREADS``, else the cores),
as the float kernel: ``gemm_ms`` / ``gemm_gflops``, and ``gemm_equal`` (bit for bit the decode
step's int8 product).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx

from mlx_serving.models import native
from mlx_serving.models.decoder.cpu import pool_threads

SHAPES = [(rows, out, inn, bits) for rows in (1, 8, 32, 512)
          for out, inn, bits in ((960, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8))]


def _median_ms(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def measure(rows: int, out: int, inn: int, bits: int, repeats: int) -> dict[str, float | int]:
    kernel = native.quantized_matmul_cpu()
    x = mx.random.normal((rows, inn))
    w, s, b = mx.quantize(mx.random.normal((out, inn)) * 0.1, group_size=32, bits=bits)
    mx.eval(x, w, s, b)
    theirs = lambda: mx.eval(mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=bits))  # noqa: E731
    ours = lambda: mx.eval(kernel(x, w, s, b, 32, bits))  # noqa: E731
    module = native.cpu_decode_module()
    matrix = module.QMatrix(w, s, b, None, bits, 32)
    int8 = lambda: mx.eval(module.int8_matmul(matrix, x))  # noqa: E731
    gemm = lambda: mx.eval(module.int8_quantized_matmul(x, w, s, b, 32, bits, pool_threads()))  # noqa: E731
    mlx_ms, native_ms, int8_ms, gemm_ms = [], [], [], []
    for _ in range(3):  # alternating
        mlx_ms.append(_median_ms(theirs, repeats))
        native_ms.append(_median_ms(ours, repeats))
        int8_ms.append(_median_ms(int8, repeats))
        gemm_ms.append(_median_ms(gemm, repeats))
    diff = mx.abs(kernel(x, w, s, b, 32, bits) - mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32,
                                                                     bits=bits)).max().item()
    ref = kernel(x, w, s, b, 32, bits)
    rel = (mx.abs(module.int8_matmul(matrix, x) - ref).max() / mx.abs(ref).max()).item()
    flops = 2 * rows * out * inn
    m, n, i8, g = (statistics.median(v) for v in (mlx_ms, native_ms, int8_ms, gemm_ms))
    equal = mx.array_equal(module.int8_quantized_matmul(x, w, s, b, 32, bits, pool_threads()),
                           module.int8_matmul(matrix, x)).item()
    return {"rows": rows, "out": out, "in": inn, "bits": bits, "mlx_ms": m, "native_ms": n,
            "mlx_gflops": flops / m / 1e6, "native_gflops": flops / n / 1e6, "speedup": m / n, "max_abs_diff": diff,
            "int8_ms": i8, "int8_gflops": flops / i8 / 1e6, "int8_rel_diff": rel, "gemm_ms": g,
            "gemm_gflops": flops / g / 1e6, "gemm_equal": equal}


GEMM_SHAPES = ((960, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8))


def measure_gemm(rows: int, out: int, inn: int, bits: int, repeats: int) -> dict[str, float | int | str]:
    """The int8 GEMM's median wall time and GMAC/s, and GMAC per CPU-second of the process (what a
    shared machine's other jobs disturb least; with ``OMP_NUM_THREADS=1``, one core's speed), for
    ``rows`` x (``out`` x ``inn``) at ``bits``; for 1-4 rows also the one-row product on one thread
    (``int8_matmul``: the decode step's qgemv before issue 39's packing, the packed one-row micro
    kernel after), GMAC per CPU-second."""
    module = native.cpu_decode_module()
    x = mx.random.normal((rows, inn))
    w, s, b = mx.quantize(mx.random.normal((out, inn)) * 0.1, group_size=32, bits=bits)
    mx.eval(x, w, s, b)
    threads = pool_threads()
    matrix = module.QMatrix(w, s, b, None, bits, 32)
    if hasattr(module, "int8_packed_matmul"):
        kernel, fn = "packed", lambda: mx.eval(module.int8_packed_matmul(matrix, x, threads))  # noqa: E731
    else:
        kernel, fn = "unpacked per call", lambda: mx.eval(module.int8_quantized_matmul(x, w, s, b, 32, bits, threads))  # noqa: E731
    macs = rows * out * inn
    ms, cpu_ms = _median_ms(fn, repeats), _median_ms(fn, repeats, time.process_time)
    row: dict[str, float | int | str] = {"rows": rows, "out": out, "in": inn, "bits": bits, "kernel": kernel,
                                         "gemm_ms": ms, "gmacs": macs / ms / 1e6, "gmacs_cpu": macs / cpu_ms / 1e6}
    if rows <= 4:
        one = _median_ms(lambda: mx.eval(module.int8_matmul(matrix, x)), repeats, time.process_time)
        row["one_row_gmacs_cpu"] = macs / one / 1e6
    return row
def gemm_table(rows: list[int], repeats: int) -> list[dict[str, float | int | str]]:
    """:func:`measure_gemm` for every M in ``rows`` and shape, printed a row per M."""
    results = []
    for m in rows:
        line = [measure_gemm(m, *shape, repeats=repeats if m < 512 else max(3, repeats // 4)) for shape in GEMM_SHAPES]
        results += line
        print(f"M {m:>4} ({line[0]['kernel']}) GMAC/s, wall / per CPU-s" + (" / one-row per CPU-s" if m <= 4 else "")
              + ":  " + "  ".join(f"{r['out']}x{r['in']} q{r['bits']} {r['gmacs']:5.1f} / {r['gmacs_cpu']:5.1f}"
                                  + (f" / {r['one_row_gmacs_cpu']:5.1f}" if m <= 4 else "") for r in line), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description="The native CPU quantized matmul beside MLX's mx.quantized_matmul "
                                             "on SmolLM2-135M's layer shapes (ms, GFLOP/s, largest difference).")
    ap.add_argument("--repeats", type=int, default=7, help="calls per kernel and shape (the median is kept)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512], help="the row counts timed")
    ap.add_argument("--gemm-only", action="store_true", help="time the int8 GEMM alone, a row per M (--gemm-rows)")
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 16, 24, 32, 40, 64, 512],
                    help="the row counts of --gemm-only")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_kernels.json",
                    help="the JSON report")
    args = ap.parse_args()
    if native.quantized_matmul_cpu() is None:
        raise SystemExit(f"the native kernel is not available: {native.unavailable_reason()}")
    results: list[dict[str, float | int | str]] = []
    if args.gemm_only:
        results = gemm_table(args.gemm_rows, args.repeats)
    for shape in [sh for sh in SHAPES if sh[0] in args.rows and not args.gemm_only]:
        results.append(measure(*shape, repeats=args.repeats if shape[0] < 512 else 3))
        r = results[-1]
        print(f"{r['rows']:>4} x {r['out']:>5} x {r['in']:>4} q{r['bits']}: MLX {r['mlx_ms']:8.3f} ms "
              f"({r['mlx_gflops']:5.1f} GFLOP/s)  native {r['native_ms']:7.3f} ms ({r['native_gflops']:5.1f})  "
              f"x{r['speedup']:.1f}  max |diff| {r['max_abs_diff']:.1e}  int8 (1 thread) {r['int8_ms']:7.3f} ms "
              f"({r['int8_gflops']:5.1f}, rel diff {r['int8_rel_diff']:.1e})  int8 GEMM {r['gemm_ms']:7.3f} ms "
              f"({r['gemm_gflops']:5.1f}, equal {r['gemm_equal']})", flush=True)
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "mlx": mx.__version__,
            "isa": native._load().isa(), "int8_isa": native.cpu_decode_module().decoder_isa(), "loadavg": os.getloadavg(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
