"""What one MLX primitive costs the host on MLX's CUDA build (issue 43): the ``mx.async_eval`` time of a
chain of N dependent launches, per launch, for a custom kernel whose cubin is small (~4 KB) or large
(~69 KB: the same kernel with a 64 KiB ``__constant__`` table), and for MLX's own ``add``.

MLX's ``CustomKernel::eval_gpu`` hashes the kernel's whole binary (``std::hash`` of the cubin) at
every launch to find its module; this measures whether that shows. Run on the GPU:
``python bench/gpu_launch_cost.py --out FILE`` (JSON: microseconds per launch, median of 5 chains).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mlx_serving.models.decoder.cuda_build import cubin  # noqa: E402


def _source(pad: int) -> str:
    table = (f"__constant__ unsigned int pad_[{pad}] = {{{', '.join(str(i * 2654435761 % 2**32) for i in range(pad))}}};\n"
             if pad else "")
    use = f" + (float)pad_[i % {pad}]" if pad else ""
    return (table + f'extern "C" __global__ void add_one_{pad}(const float* x, float* o, int n) {{\n'
            f"  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) o[i] = x[i] + 1.f{use};\n}}\n")


def kernel(pad: int) -> tuple[Callable[[mx.array], mx.array], int]:
    """A one-input, one-output custom kernel over 256 floats and the size of its cubin (bytes)."""
    name, src = f"add_one_{pad}", _source(pad)
    binary = cubin(src, name)

    def call(x: mx.array) -> mx.array:
        return mx.fast.precompiled_cuda_kernel(name=name, compiled_source=binary, inputs=[x], output_shapes=[x.shape],
                                               output_dtypes=[x.dtype], scalars=[x.size], grid=(x.size, 1, 1),
                                               threadgroup=(256, 1, 1))[0]
    return call, len(binary)


def per_launch_us(op: Callable[[mx.array], mx.array], n: int) -> dict[str, float]:
    """Host microseconds per launch to build and to encode (``mx.async_eval``) a chain of ``n`` ops."""
    builds, encodes = [], []
    for _ in range(6):
        x = mx.zeros((256,), dtype=mx.float32)
        mx.eval(x)
        t0 = time.perf_counter()
        for _ in range(n):
            x = op(x)
        t1 = time.perf_counter()
        mx.async_eval(x)
        t2 = time.perf_counter()
        mx.eval(x)
        builds.append((t1 - t0) / n * 1e6)
        encodes.append((t2 - t1) / n * 1e6)
    return {"build_us": statistics.median(builds[1:]), "encode_us": statistics.median(encodes[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_launch_cost.json"))
    args = ap.parse_args()
    out: dict[str, object] = {"mlx": mx.__version__, "n": args.n}
    for pad in (0, 16384):
        op, size = kernel(pad)
        out[f"custom_kernel_{size}B"] = per_launch_us(op, args.n)
    out["mlx_add"] = per_launch_us(lambda x: x + 1.0, args.n)
    print(json.dumps(out, indent=1))
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
