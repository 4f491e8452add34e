# Sourced by the GPU session scripts (bench/gpu_issue*.sh) on the device machine: installs the
# wheels staged by ../shared/gpu/stage-mlx-cuda (call 1 copied .gpuA's half to $HOME/gpu; this call
# carries .gpuB) into $HOME/gpu/site once per machine, sets PYTHONPATH, and defines `part`.
test -f "$HOME/gpu/part_aa" || { echo "machine went cold: repeat call 1"; exit 3; }
if [ ! -d "$HOME/gpu/site/mlx" ]; then
  cat "$HOME/gpu/part_aa" .gpuB/part_ab > "$HOME/gpu/$(cat .gpuB/CUDA_WHEEL_NAME)"
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$HOME/gpu/site" "$HOME"/gpu/*.whl .gpuB/*.whl
fi
export PYTHONPATH="$HOME/gpu/site:$PWD/src:$PWD" PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
LEASE_CALL_S=${LEASE_CALL_S:-580}  # what one device call may spend on its parts

part() {  # part NAME CAP_S COMMAND...: under a timeout, output in $OUT/NAME.log, a row in $OUT/parts.tsv
  local name=$1 cap=$2 rc=0 t0=$SECONDS
  shift 2
  local left=$(( LEASE_CALL_S - SECONDS ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then echo "== $name: skipped, no time left"; printf '%s\tskipped\t0\n' "$name" >> "$OUT/parts.tsv"; return 0; fi
  echo "== $name (at ${SECONDS} s, cap ${cap} s)"
  timeout -k 5 "$cap" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  tail -n 30 "$OUT/$name.log"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/parts.tsv"
}
