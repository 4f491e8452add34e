#!/usr/bin/env bash
# Issue 42's GPU session (H200, CUDA 13, Python 3.12, no registry): the int8 / int4 KV cache beside
# the float cache at 128 rows and under arrivals (bench/gpu_kv_quant.py; docs/benchmarks.md
# "Issue 42 on the H200"). Before it, in the checkout the device tool sends:
#   ../shared/gpu/stage-mlx-cuda 0.32.4 msgspec==0.23.0 mlx-lm==0.32.2 sniffio==1.3.1
# call 1 (carry .gpuA): mkdir -p $HOME/gpu && cp .gpuA/part_aa $HOME/gpu/
# then, warm, one call per part (carry .gpuB, and .gpuwt when the code to run is a copy of another
# worktree's src/ bench/: GPU_TREE=.gpuwt):
#   bash bench/gpu_kv_quant.sh rows128    128 uniform requests: Serving, bare engine, 4-bit Serving
#   bash bench/gpu_kv_quant.sh arrivals   chat arrivals from a fresh serving at RATES (default 16,32)
# CONFIGS (default auto,int8,int4) and ROUNDS (default 3, the first a warm-up left out of the
# medians) are passed on, and any further arguments; the runs alternate and stop inside
# LEASE_CALL_S (default 580) s; the JSON goes to $OUT/gpu_kv_quant_<part>.json (the first run
# writes the seeded checkpoint, /tmp/qwen3-0.6b-bench, when the machine has none).
set -euo pipefail
source bench/gpu_lease.sh
tree=${GPU_TREE:-.}
export PYTHONPATH="$HOME/gpu/site:$PWD/$tree/src:$PWD/$tree"
cd "$tree"
python3 -c 'import mlx.core as mx; print(mx.default_device(), mx.__version__)'
part=${1:?usage: $0 rows128 | arrivals [more gpu_kv_quant.py arguments]}
python3 bench/gpu_kv_quant.py --part "$part" --configs "${CONFIGS:-auto,int8,int4}" --rounds "${ROUNDS:-3}" \
  --rates "${RATES:-16,32}" --budget-s $(( LEASE_CALL_S - SECONDS - 10 )) --out "$OUT/gpu_kv_quant_$part.json" "${@:2}"
