#!/usr/bin/env bash
# Train the embedded retrieval model (sparsejax.train.pretrain, --size default) on one H200 and
# export it into $OUT/retrieval-tiny/ (default OUT=out; copy that folder to
# models/assets/retrieval-tiny/ to ship it).
#
# Under 8 minutes of wall clock in all (7.8 for the shipped model):
#   ~20 s   imports and device start-up (data worker processes start meanwhile)
#   ~60 s   compiling the train step of each curriculum stage and the eval's generate(), in
#           parallel threads, then one timed step per stage to plan the step counts
#   7 min   training (--minutes 7, the 8 periodic greedy evals included)
#   ~15 s   the final greedy eval (32 samples per task and context) and the export
#
# Output in $OUT:
#   retrieval-tiny/{config.json, model.safetensors (15.5 MiB, bf16), tokenizer.json,
#                   tokenizer_config.json, training_log.json, training_curve.png}
#   train.log   (the run's output)
# Checkpoints go to /tmp: running the script again on the same machine resumes the run.
#
# Arguments are passed on to `sparsejax pretrain` (later ones win), e.g. training on from a
# trained model (--init: the continued recipe):
#   bash benchmarks/train_embedded.sh --init DIR --seed 1 --minutes 3.75 \
#     --checkpoint-dir /tmp/retrieval-tiny-ckpt-continued
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-out}")
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# The model is small: 90% of the GPU's memory is plenty and leaves room for cuDNN workspaces.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export PYTHONUNBUFFERED=1

LOG="$OUT/train.log"
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
# run from outside the repository, so that its sparsejax/ folder does not shadow the package
cd /tmp
"$PY" -m sparsejax.train.pretrain --out "$OUT/retrieval-tiny" --size default --minutes 7 \
  --seed 0 --checkpoint-dir /tmp/retrieval-tiny-ckpt --checkpoint-every 1000 \
  --log-every 100 "$@" 2>&1 | tee -a "$OUT/train.log"
ls -l "$OUT/retrieval-tiny" | tee -a "$OUT/train.log"
