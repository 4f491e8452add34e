#!/usr/bin/env bash
# Issue 26's GPU runs (the device machine: H200, CUDA 13, Python 3.12, no registry), after
# ../shared/gpu/stage-mlx-cuda staged MLX's CUDA wheels in .gpuA/.gpuB (call 1 copies .gpuA's half
# to $HOME/gpu). Argument: "startup" (install, the CUDA kernel and fused-path tests, then
# bench/gpu_startup.py's fresh-process start-ups: cold and warm PTX cache, then warm with MLX CUDA
# graph caches of 100 and 25), "overhead" (the Serving vs the bare engine at 128) or
# "overhead_graphs N" (the same with MLX_CUDA_GRAPH_CACHE_SIZE=N). Writes into $OUT.
set -euo pipefail
source bench/gpu_lease.sh
python3 -c 'import mlx.core as mx, mlx_serving; print(mx.default_device(), mx.__version__)'
case "${1:-startup}" in
  startup)
    python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py tests/models/test_qwen3_fused_path.py \
      > "$OUT/gpu_tests.log" 2>&1 || true
    tail -5 "$OUT/gpu_tests.log"
    timeout -k 5 560 python3 bench/gpu_startup.py --parts startup --graph-caches 100 25 --out "$OUT/gpu_startup.json" 2>&1 | tail -12 ;;
  overhead)
    timeout -k 5 540 python3 bench/gpu_startup.py --parts overhead --out "$OUT/gpu_serving_vs_engine.json" 2>&1 | tail -12 ;;
  overhead_graphs)  # the same with a smaller MLX CUDA graph cache (argument 2: its size)
    MLX_CUDA_GRAPH_CACHE_SIZE="${2:-100}" timeout -k 5 540 python3 bench/gpu_startup.py --parts overhead \
      --out "$OUT/gpu_serving_vs_engine_graphs_${2:-100}.json" 2>&1 | tail -12 ;;
  probe)  # where the memory outside MLX's allocator goes; warm start-ups with a larger driver JIT cache
    mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0; }
    for envs in "" "CUDA_MODULE_LOADING=LAZY" "CUDA_MODULE_LOADING=EAGER"; do
      echo "context [$envs]: $(env $envs python3 -c 'import mlx.core as mx, subprocess, sys
mx.eval(mx.zeros((1,)))
print(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip())') MB"
    done
    echo "context + 1 matmul: $(python3 -c 'import mlx.core as mx, subprocess
a = mx.ones((512, 512)); mx.eval(a @ a)
print(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip())') MB"
    echo "torch context: $(python3 -c 'import torch, subprocess; torch.zeros(1, device="cuda")
print(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip())') MB"
    du -sh "$HOME/.nv/ComputeCache" 2>/dev/null || echo "no driver JIT cache dir"
    CUDA_CACHE_MAXSIZE=4294967296 timeout -k 5 400 python3 bench/gpu_startup.py --parts startup --idle-wait 60 \
      --out "$OUT/gpu_startup_jit_cache.json" 2>&1 | tail -3 | cut -c1-1500
    du -sh "$HOME/.nv/ComputeCache" 2>/dev/null || true ;;
  *) echo "unknown part ${1}"; exit 2 ;;
esac
