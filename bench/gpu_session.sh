#!/usr/bin/env bash
# One GPU session's runs (the device machine: H200, CUDA 13, Python 3.12, no registry), after
# ../shared/gpu/stage-mlx-cuda staged MLX's CUDA wheels in .gpuA/.gpuB (call 1 copies .gpuA's half
# to $HOME/gpu). The package is not pip-installed there: src/ goes on PYTHONPATH.
# Writes into $OUT: the test log and bench JSON. Arguments: which bench (mixed, default;
# mixed: gpu_mixed + gpu_arrivals; arrivals [RATES [DURATION]]; rest: gpu_step + prefix caching;
# throughput; all: every issue-17 bench and bench/gpu_summary.py's $OUT/gpu_all.json), then
# notests to skip the tests.
#
# all: the parts run one after another in this order: the tests (~100 s with installing);
# gpu_step.py: the copy bandwidth (every floor's denominator), compiled fused steps at 1 and 128
# rows, paged steps at position 1,500 for 1 and 256 rows, mlx-lm one stream; gpu_mixed.py at
# batches 256 and 128 with only the batch_generate peer; gpu_throughput.py at concurrency 1 and 128
# with the peer, bare engine and 4-bit rows, no arrival-under-load; prefix_cache.py on the 0.6b
# shape, 128 requests x 2,048-token system prompt, caching on vs off; gpu_arrivals.py at 8 and 16
# requests/s for 8 s each and one search step;
# then the summary. A third argument names a subset of the parts (comma-separated: step, mixed,
# throughput, prefix, arrivals). The whole does not fit one 600 s call (measured 2026-12-01 session 4,
# bench/results/gpu_all_issue17_s4/parts_call*.tsv, with Engine.warm_up building every prefill
# shape: tests 174 s, step 143 s, prefix > 200 s (the "on" process's warm-up alone 159 s), mixed
# 201 s, arrivals 78 s, throughput 251 s), so a session runs four calls on the same warm machine:
# `all tests step`, `all notests prefix`, `all notests mixed,arrivals`, `all notests throughput`,
# and bench/gpu_summary.py over the calls' files in one folder. Each part runs under `timeout` capped at its CAP and at what is left of
# ALL_BUDGET (default 570) seconds since this script started, less 15 s kept for the summary, so
# the call ends inside the device's 600 s limit whatever a part does; a part cut short or failed
# is logged (parts.tsv: name, exit status, wall s) and the next one runs. Each part's output is in
# $OUT/<part>.log; the JSON each bench writes as it goes stays in $OUT.
set -euo pipefail
test -f "$HOME/gpu/part_aa" || { echo "machine went cold: repeat call 1"; exit 3; }
cat "$HOME/gpu/part_aa" .gpuB/part_ab > "$HOME/gpu/$(cat .gpuB/CUDA_WHEEL_NAME)"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$HOME/gpu/site" "$HOME"/gpu/*.whl .gpuB/*.whl
export PYTHONPATH="$HOME/gpu/site:$PWD/src"
python3 -c 'import mlx.core as mx, mlx_serving; print(mx.default_device(), mx.__version__)'
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1  # a crash leaves its Python traceback in the part's log
setup_s=$SECONDS
[ "${2:-tests}" = notests ] || python3 -m pytest -q -p no:cacheprovider tests/models/test_qwen3_kernels_cuda.py tests/models/test_qwen3_fused_path.py \
  2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
printf 'setup\t0\t%s\ntests\t0\t%s\n' "$setup_s" "$((SECONDS - setup_s))" > "$OUT/parts.tsv"

part() {  # part NAME CAP_S COMMAND...: COMMAND under a timeout (see "all" above), output in $OUT/NAME.log
  local name=$1 cap=$2 rc=0 t0=$SECONDS
  shift 2
  local left=$(( ${ALL_BUDGET:-570} - SECONDS - 15 ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then
    echo "== $name: skipped, no time left"; printf '%s\tskipped\t0\n' "$name" >> "$OUT/parts.tsv"; return 0
  fi
  echo "== $name (at ${SECONDS} s, cap ${cap} s)"
  if command -v timeout > /dev/null; then timeout -k 5 "$cap" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  else "$@" > "$OUT/$name.log" 2>&1 || rc=$?; fi  # no coreutils timeout: uncapped
  tail -n 30 "$OUT/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/parts.tsv"
}

ckpt=/tmp/qwen3-0.6b-bench  # the seeded 0.6B-shaped checkpoint every bench shares (written by the first)
case "${1:-mixed}" in
  mixed) python3 bench/gpu_mixed.py --out "$OUT/gpu_mixed.json" 2>&1 | tail -20
         python3 bench/gpu_arrivals.py --rates 8,16 --duration 15 --search-steps 1 --out "$OUT/gpu_arrivals.json" 2>&1 | tail -20 ;;
  arrivals) python3 bench/gpu_arrivals.py --rates "${3:-8,16}" --duration "${4:-10}" --search-steps 0 \
              --out "$OUT/gpu_arrivals.json" 2>&1 | tail -12 ;;
  rest) python3 bench/gpu_step.py --batches 1,128 --variants compiled-fused --steps 40 --tag issue17 \
          --out "$OUT/gpu_step_issue17.json" 2>&1 | tail -8
        python3 bench/prefix_cache.py --preset 0.6b --ckpt "$ckpt" --requests 128 --system 2048 --regimes on,off \
          --out "$OUT/prefix_cache_0.6b.json" 2>&1 | tail -12 ;;
  throughput) python3 bench/gpu_throughput.py --concurrency 1,128,256 --peer-concurrency 1,128 \
                --out "$OUT/gpu_throughput.json" 2>&1 | tail -30 ;;
  all) parts=",${3:-step,mixed,throughput,prefix,arrivals},"  # a subset: the same session over several calls
       want() { [[ $parts == *",$1,"* ]]; }
       want step && part step 170 python3 bench/gpu_step.py --batches 1,128 --variants compiled-fused --steps 40 --no-parity \
         --context 1,256:1500 --out "$OUT/gpu_step.json"
       want mixed && part mixed 430 python3 bench/gpu_mixed.py --peer batch_generate --batches 256,128 --out "$OUT/gpu_mixed.json"
       want throughput && part throughput 320 python3 bench/gpu_throughput.py --concurrency 1,128 --peer-concurrency 1,128 \
         --load-streams 0 --out "$OUT/gpu_throughput.json"
       want prefix && part prefix 400 python3 bench/prefix_cache.py --preset 0.6b --ckpt "$ckpt" --requests 128 --system 2048 \
         --regimes on,off --out "$OUT/prefix_cache_0.6b.json"
       want arrivals && part arrivals 100 python3 bench/gpu_arrivals.py --rates 8,16 --duration 8 --search-steps 1 \
         --out "$OUT/gpu_arrivals.json"
       python3 bench/gpu_summary.py "$OUT" ;;
  *) echo "unknown case ${1}: mixed, arrivals, rest, throughput or all"; exit 2 ;;
esac
