#!/usr/bin/env bash
# Issue 37's GPU session on one H200 lease (CUDA 13, Python 3.12, no registry). Before it, here:
#   ../shared/gpu/stage-mlx-cuda 0.32.4 msgspec==0.23.0 mlx-lm==0.32.2 sniffio==1.3.1
# On the device, call 1 (carry .gpuA): mkdir -p $HOME/gpu && cp .gpuA/part_aa $HOME/gpu/
# then, the machine still warm, one call per part (carry .gpuB on the first; a part installs the
# wheels into $HOME/gpu/site when they are not there yet):
#   check   the CUDA kernel tests and the warm-shape test, bench/gpu_shape_builds.py (every shape's
#           first and second run), bench/gpu_startup.py --parts startup (cold and warm caches)
#   serve   bench/gpu_arrivals.py --workload chat --fresh at 16/32/64/128 req/s, then
#           bench/gpu_startup.py --parts overhead --peer (Serving vs engine vs batch_generate at 128)
#   mixed   bench/gpu_mixed.py at batch 256 beside batch_generate
#   final   bench/gpu_kernel_ab.py (needs bench/_old_cuda_kernels.py, untracked: git show
#           5507cc4:src/mlx_serving/models/generation/cuda_kernels.py), arrivals at 64 and 128 req/s,
#           the Serving vs the engine at 128
# Each bench runs under `timeout` at its cap and what is left of 580 s; JSON and logs go to $OUT.
set -euo pipefail
source bench/gpu_lease.sh
python3 -c 'import mlx.core as mx, mlx_serving, mlx_lm; print(mx.default_device(), mx.__version__)'
test -f /tmp/qwen3-0.6b-bench/config.json || python3 -c "from mlx_serving.models.seeded_checkpoint import \
write_checkpoint as w; w('/tmp/qwen3-0.6b-bench', '0.6b', seed=0)"
case "${1:-}" in
  check)
    part tests 150 python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py \
      tests/models/test_warm_shapes.py tests/models/test_qwen3_fused_path.py
    part shapes 150 python3 bench/gpu_shape_builds.py --out "$OUT/gpu_shape_builds.json"
    part startup 260 python3 bench/gpu_startup.py --parts startup --out "$OUT/gpu_startup.json" ;;
  serve)
    part arrivals 200 python3 bench/gpu_arrivals.py --workload chat --fresh --rates 16,32,64,128 --duration 10 \
      --search-steps 0 --deadline 20 --out "$OUT/gpu_arrivals.json"
    part overhead 300 python3 bench/gpu_startup.py --parts overhead --peer --out "$OUT/gpu_overhead.json" ;;
  final)  # the second lease: kernels A/B, the two highest rates, the Serving's overhead
    part ab 160 python3 bench/gpu_kernel_ab.py --out "$OUT/gpu_kernel_ab.json"
    part arrivals 170 python3 bench/gpu_arrivals.py --workload chat --fresh --rates 64,128 --duration 10 \
      --search-steps 0 --deadline 20 --out "$OUT/gpu_arrivals_64_128.json"
    part overhead 120 python3 bench/gpu_startup.py --parts overhead --out "$OUT/gpu_overhead.json" ;;
  mixed)
    part mixed 570 python3 bench/gpu_mixed.py --peer batch_generate --batches 256 --out "$OUT/gpu_mixed.json" ;;
  *) echo "usage: $0 check | serve | final | mixed"; exit 2 ;;
esac
