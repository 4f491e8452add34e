#!/usr/bin/env bash
# One GPU session's runs (the device machine: H200, CUDA 13, Python 3.12, no registry), after
# ../shared/gpu/stage-mlx-cuda staged MLX's CUDA wheels in .gpuA/.gpuB (call 1 copies .gpuA's half
# to $HOME/gpu). The package is not pip-installed there: links in the machine's copy of
# mlx_serving/ put the repository's folders under the distribution namespace, as setuptools'
# package-dir mapping does.
# Writes into $OUT: the test log and bench JSON. Arguments: which bench (paged, default; context;
# mixed: gpu_mixed + gpu_arrivals; rest: gpu_step + prefix caching; throughput), then notests to skip the tests.
set -euo pipefail
test -f "$HOME/gpu/part_aa" || { echo "machine went cold: repeat call 1"; exit 3; }
cat "$HOME/gpu/part_aa" .gpuB/part_ab > "$HOME/gpu/$(cat .gpuB/CUDA_WHEEL_NAME)"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$HOME/gpu/site" "$HOME"/gpu/*.whl .gpuB/*.whl
for d in serving models tokenization; do ln -sfn "../$d" "mlx_serving/$d"; done
export PYTHONPATH="$HOME/gpu/site:$PWD"
python3 -c 'import mlx.core as mx, mlx_serving; print(mx.default_device(), mx.__version__)'
[ "${2:-tests}" = notests ] || python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py tests/models/test_qwen3_fused_path.py \
  2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
case "${1:-paged}" in
  paged) python3 bench/gpu_paged.py --out "$OUT/gpu_paged.json" 2>&1 | tail -10 ;;
  context) python3 bench/gpu_paged.py --context 1,32,128,256:200,800,1500 --out "$OUT/gpu_context.json" 2>&1 | tail -14 ;;
  mixed) python3 bench/gpu_mixed.py --out "$OUT/gpu_mixed.json" 2>&1 | tail -20
         python3 bench/gpu_arrivals.py --rates 8,16 --duration 15 --search-steps 1 --out "$OUT/gpu_arrivals.json" 2>&1 | tail -20 ;;
  arrivals) python3 bench/gpu_arrivals.py --rates "${3:-8,16}" --duration "${4:-10}" --search-steps 0 \
              --out "$OUT/gpu_arrivals.json" 2>&1 | tail -12 ;;
  rest) python3 bench/gpu_step.py --batches 1,128 --variants compiled-fused --steps 40 --tag issue17 2>&1 | tail -8
        cp bench/results/gpu_step_issue17.json "$OUT/"
        python3 bench/prefix_cache.py --preset 0.6b --requests 128 --system 2048 --regimes on,off 2>&1 | tail -12
        cp bench/results/prefix_cache_0.6b*.json "$OUT/" ;;
  throughput) python3 bench/gpu_throughput.py --concurrency 1,128,256 --peer-concurrency 1,128 \
                --out "$OUT/gpu_throughput.json" 2>&1 | tail -30 ;;
esac
