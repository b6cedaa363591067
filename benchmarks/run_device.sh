#!/usr/bin/env bash
# Everything that needs the GPU, in one command: install, native kernel tests, benchmarks.
#
#   bash benchmarks/run_device.sh [STEP ...]
#   steps: tests (kernel tests natively, --gpu; TESTS= overrides the files), topk, decode, sparse, step (decode step of
#          the whole model), all (default: tests topk decode sparse step)
#
# Results land in benchmarks/results/*.json|png and, when OUT is set, in $OUT (the scripts copy
# them there); every step's full output goes to $OUT/device.log. Runs on the image's python3
# (jax with CUDA), offline.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}

LOG="$OUT/device.log"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"

steps=("$@")
[ ${#steps[@]} -eq 0 ] || [ "${steps[0]}" = all ] && steps=(tests topk decode sparse step)
status=0
for s in "${steps[@]}"; do
  start=$(date +%s)
  case $s in
    tests)  cmd=($PY -m pytest -q -p no:cacheprovider --gpu -n 8 ${TESTS:-tests/test_decode_attention.py
                 tests/test_sparse_attention.py tests/test_topk.py}) ;;
    topk)   cmd=($PY benchmarks/bench_topk.py) ;;
    decode) cmd=($PY benchmarks/bench_decode_attention.py) ;;
    sparse) cmd=($PY benchmarks/bench_sparse_attention.py) ;;
    step)   cmd=($PY benchmarks/bench_decode_step.py) ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
  echo "== $s: ${cmd[*]}"
  echo "== $s" >>"$LOG"
  "${cmd[@]}" >"$OUT/step.tmp" 2>&1
  rc=$?
  cat "$OUT/step.tmp" >>"$LOG"
  [ $rc -eq 0 ] || status=$rc
  echo "== $s: exit $rc in $(( $(date +%s) - start )) s"
  tail -n 30 "$OUT/step.tmp"
  rm -f "$OUT/step.tmp"
done
exit $status
