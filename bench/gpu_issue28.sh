#!/usr/bin/env bash
# Issue 28's GPU session: ours, mlx-lm and llama.cpp's CUDA build on one H200 lease (CUDA 13,
# Python 3.12, no registry). Before it, here: ../shared/gpu/stage-mlx-cuda 0.32.4 with the extra
# wheels bench/gpu_issue28.sh stage lists (MLX's CUDA wheel in .gpuA/.gpuB), and the trimmed
# llama.cpp source in .lcpp/llamacpp-src.tgz (bench/gpu_llamacpp.py's docstring). On the device,
# call 1 (carry .gpuA and .lcpp) copies .gpuA/part_aa to $HOME/gpu and starts the llama.cpp build:
#   mkdir -p $HOME/gpu && cp .gpuA/part_aa $HOME/gpu/ &&
#   python3 bench/gpu_llamacpp.py build --src .lcpp/llamacpp-src.tgz --work $HOME/lcpp --jobs 14
# then, the machine still warm, one call per part (carry .gpuB on the first; each part installs the
# wheels into $HOME/gpu/site when they are not there yet):
#   llamacpp    the weights and GGUF files, llama-bench / llama-batched-bench, bench/gpu_step.py (the
#               copy bandwidth and the floor inputs, paged steps at position 1,500)
#   throughput  bench/gpu_throughput.py at 1 and 128 beside generate_step / batch_generate
#   mixed       bench/gpu_mixed.py at batch 256 beside batch_generate
#   arrivals    bench/gpu_arrivals.py at 64 req/s
#   server      llama-server (as shipped, and with --backend-sampling) vs mlx-serving serve at 128,
#               1 and 32 parallel slots under one HTTP load
# One call each (what 2026-12-03's lease 3 measured: gpu_throughput.py's one-stream part alone
# took ~250 s on a fresh lease, mixed's batch_generate peer more than 170 s). Measured on
# 2026-12-03 with the parts then named "llamacpp" (weights, mixed, tools) and "rest" (weights,
# step, throughput, server): bench/results/gpu_issue28/parts_by_lease.txt.
# Each bench runs under `timeout` at its cap and what is left of 580 s; JSON and logs go to $OUT.
# bench/gpu_summary.py FOLDER (here, no MLX needed) makes the table from the parts' files.
set -euo pipefail
if [ "${1:-}" = stage ]; then  # here: the wheels the device lacks (the server extra, httpx, mlx-lm)
  exec ../shared/gpu/stage-mlx-cuda 0.32.4 msgspec==0.23.0 tqdm==4.70.1 sniffio==1.3.1 mlx-lm==0.32.2 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 sse-starlette==3.7.1 prometheus_client==0.26.0 \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
    typing_extensions==4.16.0 opentelemetry-api==1.45.2 click==8.5.1 h11==0.16.0 httpx==0.29.0 httpcore==1.0.9 \
    idna==3.20 certifi
fi
source bench/gpu_lease.sh
python3 -c 'import mlx.core as mx, mlx_serving, mlx_lm, mlx_serving.server, uvicorn, httpx; print(mx.default_device(), mx.__version__)'
work=$HOME/lcpp
case "${1:-}" in
  llamacpp)
    part weights 150 python3 bench/gpu_llamacpp.py weights --work "$work"
    part tools 400 python3 bench/gpu_llamacpp.py tools --work "$work" --out "$OUT/gpu_llamacpp_tools.json"
    part step 150 python3 bench/gpu_step.py --batches 1,128 --variants compiled-fused --steps 30 --no-parity \
      --no-mlx-lm --context 1,256:1500 --out "$OUT/gpu_step.json" ;;
  throughput)
    part throughput 570 python3 bench/gpu_throughput.py --concurrency 1,128 --peer-concurrency 1,128 --load-streams 0 \
      --out "$OUT/gpu_throughput.json" ;;
  mixed)
    part mixed 570 python3 bench/gpu_mixed.py --peer batch_generate --batches 256 --out "$OUT/gpu_mixed.json" ;;
  arrivals)
    part arrivals 200 python3 bench/gpu_arrivals.py --rates 64 --duration 10 --search-steps 0 --out "$OUT/gpu_arrivals.json" ;;
  server)
    part server 570 python3 bench/gpu_llamacpp.py server --work "$work" --levels 128,1,32 --rounds 3 \
      --out "$OUT/gpu_llamacpp_server.json" ;;
  *) echo "usage: $0 stage | llamacpp | throughput | mixed | arrivals | server"; exit 2 ;;
esac
