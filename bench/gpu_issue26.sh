#!/usr/bin/env bash
# Issue 26's GPU runs (the device machine: H200, CUDA 13, Python 3.12, no registry), after
# ../shared/gpu/stage-mlx-cuda staged MLX's CUDA wheels in .gpuA/.gpuB (call 1 copies .gpuA's half
# to $HOME/gpu). Argument: "startup" (install, the CUDA kernel and fused-path tests, then
# bench/gpu_startup.py's two fresh-process start-ups) or "overhead" (the Serving vs the bare engine
# at 128). Writes into $OUT.
set -euo pipefail
test -f "$HOME/gpu/part_aa" || { echo "machine went cold: repeat call 1"; exit 3; }
if [ ! -d "$HOME/gpu/site/mlx" ]; then
  cat "$HOME/gpu/part_aa" .gpuB/part_ab > "$HOME/gpu/$(cat .gpuB/CUDA_WHEEL_NAME)"
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$HOME/gpu/site" "$HOME"/gpu/*.whl .gpuB/*.whl
fi
export PYTHONPATH="$HOME/gpu/site:$PWD/src:$PWD" PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
python3 -c 'import mlx.core as mx, mlx_serving; print(mx.default_device(), mx.__version__)'
case "${1:-startup}" in
  startup)
    python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py tests/models/test_qwen3_fused_path.py \
      > "$OUT/gpu_tests.log" 2>&1 || true
    tail -5 "$OUT/gpu_tests.log"
    timeout -k 5 420 python3 bench/gpu_startup.py --parts startup --out "$OUT/gpu_startup.json" 2>&1 | tail -12 ;;
  overhead)
    timeout -k 5 540 python3 bench/gpu_startup.py --parts overhead --out "$OUT/gpu_serving_vs_engine.json" 2>&1 | tail -12 ;;
  *) echo "unknown part ${1}"; exit 2 ;;
esac
