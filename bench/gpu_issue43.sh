#!/usr/bin/env bash
# Issue 43's GPU session (H200, CUDA 13, Python 3.12, no registry): the one-stream decode step.
# Before it, in the checkout the device tool sends: ../shared/gpu/stage-mlx-cuda 0.32.4 msgspec==0.23.0
# mlx-lm==0.32.2 sniffio==1.3.1; call 1 (carry .gpuA): mkdir -p $HOME/gpu && cp .gpuA/part_aa $HOME/gpu/
# then, warm, call 2 (carry .gpuB, and .gpuwt when the code to run is a copy of another worktree's
# src/ bench/ tests/ pyproject.toml: GPU_TREE=.gpuwt): bash bench/gpu_issue43.sh
#   tests  the CUDA kernel tests (qmv against MLX's quantized_matmul, generations equal the generic path)
#   step   bench/gpu_step.py at 1 and 4 rows: the generic path, the fused kernels with MLX's matmuls
#          (fusedmm) and with the folded 4-bit products (fused), eager and compiled, each with its
#          primitives per step, encode time, floor and the Engine's one-stream tok/s and greedy ids
#   launch bench/gpu_launch_cost.py: host time per MLX primitive (custom kernels of small and large cubins, add)
set -euo pipefail
source bench/gpu_lease.sh
tree=${GPU_TREE:-.}
export PYTHONPATH="$HOME/gpu/site:$PWD/$tree/src:$PWD/$tree"
cd "$tree"
python3 -c 'import mlx.core as mx; print(mx.default_device(), mx.__version__)'
test -f /tmp/qwen3-0.6b-bench/config.json || python3 -c "from mlx_serving.models.seeded_checkpoint import \
write_checkpoint as w; w('/tmp/qwen3-0.6b-bench', '0.6b', seed=0)"
part tests 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py
part launch 40 python3 bench/gpu_launch_cost.py --out "$OUT/gpu_launch_cost.json"
part step 300 python3 bench/gpu_step.py --batches 1,4 --engine --no-parity \
  --variants matmul,fusedmm,compiled-fusedmm,compiled-fused --out "$OUT/gpu_step_issue43.json"
cat "$OUT/parts.tsv"
