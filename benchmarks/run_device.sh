#!/usr/bin/env bash
# Everything that needs the GPU, in one command: install, native kernel tests, benchmarks.
#
#   bash benchmarks/run_device.sh [STEP ...]
#   steps: tests (kernel tests natively, --gpu; TESTS= overrides the files), topk, decode, sparse, step (decode step of
#          the whole model), prefill (prefill attention, sparse prefill, correction), selecting
#          (selecting layers vs dense at decode: Kascade's Table 3; SELECTING_ARGS= adds flags),
#          spec (lossless mode: acceptance and speed on the embedded model, the cost model on
#          DS-Qwen-1.5B shapes, planned for about 4 minutes on an H200), tp (tensor parallel on every GPU of the host;
#          TP_PARTS= picks parts; on 4 GPUs tp-a then tp-b split it over two calls, joined
#          by bench_tensor_parallel.py --merge), fidelity and calibration (benchmarks/fidelity.py's measurements
#          of the embedded model, below), memory (benchmarks/memory_probe.py: each program's
#          memory analysis and cache-sized copies, compiled from shapes, a few minutes),
#          compile (benchmarks/bench_compile.py: generate's and the decode step's compile
#          seconds and memory analysis from shapes; COMPILE_ARGS= adds flags),
#          fp8 (benchmarks/bench_fp8.py: the kernels on an fp8 cache beside bf16),
#          capacity (the largest batch generate runs per context and method, --quick by
#          default: about 6 minutes; CAPACITY_ARGS= replaces the flags), peer-capacity
#          (jax-llm-examples' Llama 3 decode_step at the same shapes; PEER_LLAMA3= its llama3/
#          folder, default build/jax-llm-examples/llama3), all (default: tests topk decode
#          sparse step), fidelity-real (SmolLM2's table; SPARSEJAX_REAL_MODEL= the GGUF file),
#          fidelity-kv (SmolLM2 over a bf16 and an fp8 cache, one GPU each where there are two,
#          then their comparison)
#
# Results land in benchmarks/results/*.json|png and, when OUT is set, in $OUT (the scripts copy
# them there); every step's full output goes to $OUT/device.log. Runs on the image's python3
# (jax with CUDA), offline.
set -uo pipefail
cd "$(dirname "$0")/.."
# JAX's allocator takes 75% of the GPU by default: a 16-row 32k Llama-8B cache (64 GiB) beside
# the weights (15 GiB) would not fit in it
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
# The steps that fill the card run preallocated (JAX's default: one pool region per GPU, so a
# cache near the card's size finds one block; a pool grown region by region refused 48 GiB
# with 60 GiB free) at their scripts' own memory fraction.
FILL=(env -u XLA_PYTHON_CLIENT_MEM_FRACTION XLA_PYTHON_CLIENT_PREALLOCATE=true)

LOG="$OUT/device.log"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import jax, jaxlib, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'triton', triton.__version__, jax.devices())"

# The embedded model's fidelity measurements, in parallel processes on the one GPU (their
# compiles overlap); f32 at "highest" matmul precision, like the CPU runs.
#   fidelity:    every method and its RESA variant on all four tasks at 4096 tokens, budgets
#                10% / 25% -> results/fidelity.json (+ .png), then resa_error.json
#   calibration: at 2048 tokens, calibrated DELTA/Kascade layers against evenly spaced ones
#                (written beside the model, models/assets/retrieval-tiny/calibration/, where
#                eval and the demo read them; results/calibration.json) and the shipped Lychee gates
#                against random heads (gates.json)
# Each process stops after FIDELITY_LIMIT_S seconds; groups that ran out of time are left out.
# FIDELITY_GROUPS="i j" runs only those groups of fidelity() and merges them into the table.
export_fidelity_env() {
  # batch 8: the f32 prefill's [8, 8, 4096, 4096] scores are 4.3 GB per layer
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.22 JAX_DEFAULT_MATMUL_PRECISION=highest
  limit=${FIDELITY_LIMIT_S:-1800}
  root=$PWD model=$PWD/models/assets/retrieval-tiny
}

# On a 4-GPU host, the one- and two-GPU cells at once on disjoint GPUs (tp-a), and the
# four-GPU cells (tp-b), each in one device call; `bench_tensor_parallel.py --merge` joins the
# files they leave in $OUT.
# TP_SIDE="step ..." runs those one-GPU steps on the fourth GPU meanwhile (results in $OUT/side).
tp_disjoint() {
  local bench="${FILL[*]} $PY benchmarks/bench_tensor_parallel.py"
  CUDA_VISIBLE_DEVICES=0,1 $bench --parts scaling,delta --tps 2 --name tp2 >"$OUT/tp2.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=2 $bench --parts scaling,capacity --tps 1 --name tp1 >"$OUT/tp1.log" 2>&1 &
  if [ -n "${TP_SIDE:-}" ]; then
    mkdir -p "$OUT/side"
    (export CUDA_VISIBLE_DEVICES=3 OUT="$OUT/side" LOG="$OUT/side/device.log"
     for s in $TP_SIDE; do run_step "$s"; done) >"$OUT/side.log" 2>&1 &
  fi
  local failed=0
  for job in $(jobs -p); do wait "$job" || failed=1; done
  tail -n 40 "$OUT"/tp*.log
  return $failed
}

fidelity() (  # a subshell: its environment (a small memory fraction) ends with it
  export_fidelity_env
  local dir; dir=$(mktemp -d)
  # the last two groups: Kascade's sparse prefill, and cache correction every 4 generated
  # tokens (answers are at most 16 tokens, so every 32 would never run)
  local groups=("dense,oracle,oracle+resa,streaming,streaming+resa" "quest,quest+resa,tidal,tidal+resa"
                "delta,delta+resa,kascade,kascade+resa" "lychee,lychee+resa" "kascade" "lychee,tidal")
  local extra=("" "" "" "" "--sparse-prefill" "--correct-every 4")
  local i
  for i in "${!groups[@]}"; do
    [ -z "${FIDELITY_GROUPS:-}" ] || [[ " $FIDELITY_GROUPS " == *" $i "* ]] || continue
    # outside the repository, so that its sparsejax/ folder does not shadow the package
    (cd /tmp && timeout "$limit" $PY -m sparsejax eval --task niah,multikey,multivalue,vt \
       --context 4096 --samples 8 --batch 8 --methods "${groups[$i]}" --budget-ratio 0.1,0.25 \
       ${extra[$i]} --no-timing --json "$dir/part$i.json") &
  done
  wait
  # a partial rerun (FIDELITY_GROUPS="4 5") merges into the committed table
  local base=(); [ -z "${FIDELITY_GROUPS:-}" ] || base=(benchmarks/results/fidelity.json)
  $PY benchmarks/fidelity.py merge "${base[@]}" "$dir"/part*.json &&
    $PY benchmarks/fidelity.py resa benchmarks/results/fidelity.json
)

calibration() (  # a subshell, as fidelity
  export_fidelity_env
  (cd /tmp && timeout "$limit" $PY -m sparsejax calibrate --method delta \
     --out "$model/calibration/delta.json" --plot "$root/benchmarks/results" &&
   timeout "$limit" $PY -m sparsejax calibrate --method kascade \
     --out "$model/calibration/kascade.json" --plot "$root/benchmarks/results" &&
   timeout "$limit" $PY "$root/benchmarks/fidelity.py" calibration \
     --delta "$model/calibration/delta.json" --kascade "$model/calibration/kascade.json") &
  (cd /tmp && timeout "$limit" $PY "$root/benchmarks/fidelity.py" gates \
     --gates "$model/gates/target-4.json" "$model/gates/target-8.json") &
  wait
  for f in delta_shift kascade_layer_similarity; do
    mv -f "benchmarks/results/$f.png" "benchmarks/results/calibration_$f.png"
  done
)

# SmolLM2's fidelity with the cache in bf16 and in fp8 (the model in float32), then each cell's
# fp8 answers against bf16's -> results/fidelity_real_{bf16,fp8,kv_dtype}.json.
FIDELITY_KV_METHODS=${FIDELITY_KV_METHODS:-dense,oracle,streaming,quest,tidal,delta,kascade,lychee,delta+resa,kascade+resa,lychee+resa}
fidelity_kv() {
  local rc=0 a b
  one() {
    CUDA_VISIBLE_DEVICES=$2 $PY benchmarks/fidelity_real.py --kv-dtype $1 \
      --methods "$FIDELITY_KV_METHODS" > "$OUT/fidelity_$1.log" 2>&1
  }
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    one bf16 0 & a=$!
    one fp8 1 & b=$!
    wait $a || rc=$?
    wait $b || rc=$?
  else
    one bf16 0 || rc=$?
    one fp8 0 || rc=$?
  fi
  tail -n 3 "$OUT"/fidelity_bf16.log "$OUT"/fidelity_fp8.log
  $PY benchmarks/fidelity_real.py compare benchmarks/results/fidelity_real_bf16.json \
    benchmarks/results/fidelity_real_fp8.json || rc=$?
  return $rc
}

# One step: its output to $LOG, its exit status returned, its tail printed.
run_step() {
  local s=$1 start rc cmd
  start=$(date +%s)
  case $s in
    tests)  cmd=($PY -m pytest -q -p no:cacheprovider --gpu -n 8 ${TESTS:-tests/test_decode_attention.py
                 tests/test_sparse_attention.py tests/test_topk.py tests/test_prefill_attention.py
                 tests/test_cache_write.py tests/test_merge_splits.py tests/test_gemv.py
                 tests/test_fp8_cache.py}) ;;
    topk)   cmd=($PY benchmarks/bench_topk.py --sweep-seconds ${TOPK_SWEEP_S:-300}) ;;
    matrix) cmd=($PY benchmarks/bench_decode_matrix.py ${MATRIX_ARGS:-}) ;;
    profile) cmd=($PY benchmarks/profile_step.py) ;;
    decode) cmd=($PY benchmarks/bench_decode_attention.py) ;;
    sparse) cmd=($PY benchmarks/bench_sparse_attention.py) ;;
    step)   cmd=($PY benchmarks/bench_decode_step.py) ;;
    prefill) cmd=($PY benchmarks/bench_prefill.py ${PREFILL_ARGS:-}) ;;
    selecting) cmd=($PY benchmarks/bench_selecting_layers.py ${SELECTING_ARGS:-}) ;;
    tp)     cmd=("${FILL[@]}" $PY benchmarks/bench_tensor_parallel.py --parts ${TP_PARTS:-one_gpu,delta,scaling,capacity}) ;;
    tp-a)   cmd=(tp_disjoint) ;;
    tp-b)   cmd=("${FILL[@]}" $PY benchmarks/bench_tensor_parallel.py --parts scaling,delta,capacity --tps 4
                 --name tp4) ;;
    spec)   cmd=($PY benchmarks/bench_speculative.py) ;;
    memory) cmd=($PY benchmarks/memory_probe.py ${MEMORY_ARGS:-}) ;;
    compile) cmd=($PY benchmarks/bench_compile.py ${COMPILE_ARGS:-}) ;;
    capacity) cmd=("${FILL[@]}" $PY benchmarks/bench_capacity.py ${CAPACITY_ARGS:---quick}) ;;
    fp8)    cmd=($PY benchmarks/bench_fp8.py) ;;
    peer-capacity) cmd=("${FILL[@]}" $PY benchmarks/peers/jax_llm_examples_capacity.py
                        ${PEER_LLAMA3:-build/jax-llm-examples/llama3} --json "$OUT/peer_capacity.json") ;;
    fidelity) cmd=(fidelity) ;;
    calibration) cmd=(calibration) ;;
    # SmolLM2's table (benchmarks/fidelity_real.py): the GGUF from $SPARSEJAX_REAL_MODEL
    fidelity-real) cmd=($PY benchmarks/fidelity_real.py ${FIDELITY_REAL_ARGS:-}) ;;
    fidelity-kv) cmd=(fidelity_kv) ;;
    *) echo "unknown step $s"; return 2 ;;
  esac
  echo "== $s: ${cmd[*]}"
  echo "== $s" >>"$LOG"
  "${cmd[@]}" >"$OUT/step.tmp" 2>&1
  rc=$?
  cat "$OUT/step.tmp" >>"$LOG"
  echo "== $s: exit $rc in $(( $(date +%s) - start )) s"
  tail -n 30 "$OUT/step.tmp"
  rm -f "$OUT/step.tmp"
  return $rc
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] || [ "${steps[0]}" = all ] && steps=(tests topk decode sparse prefill matrix)
status=0
for s in "${steps[@]}"; do
  run_step "$s" || status=$?
done
exit $status
