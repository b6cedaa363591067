#!/usr/bin/env bash
# Train the embedded retrieval model (sparsejax.train.pretrain, --size default) on one H200 and
# export it into $OUT/retrieval-tiny/ (then copy that folder to models/assets/retrieval-tiny/).
#
# One device call, under 9 minutes of wall clock in all:
#   ~20 s   imports and device start-up (data worker processes start meanwhile)
#   ~60 s   compiling the train step of each curriculum stage and the eval's generate(), in
#           parallel threads, then one timed step per stage to plan the step counts
#   6 min   training (--minutes 6, the 8 periodic greedy evals included)
#   ~15 s   the final greedy eval (32 samples per task and context) and the export
#
# What comes back from $OUT (7 files, at most 2 folders deep, each under 16 MiB):
#   retrieval-tiny/{config.json, model.safetensors (15.5 MiB, bf16), tokenizer.json,
#                   tokenizer_config.json, training_log.json, training_curve.png}
#   train.log   (the run's output)
# Checkpoints go to /tmp (not $OUT): a second call on a still-warm machine resumes the run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# The model is small: 90% of the GPU's memory is plenty and leaves room for cuDNN workspaces.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export PYTHONUNBUFFERED=1

# The device image has JAX but not this package: lay out the import names of pyproject's
# package-dir (sparsejax, sparsejax.models <- models/, ...) with symbolic links.
if ! "$PY" -c "import sparsejax.train.pretrain" 2>/dev/null; then
  SITE=$(mktemp -d)
  mkdir "$SITE/sparsejax"
  ln -s "$PWD"/sparsejax/* "$SITE/sparsejax/"
  ln -s "$PWD/models" "$SITE/sparsejax/models"
  ln -s "$PWD/train" "$SITE/sparsejax/train"
  ln -s "$PWD/pallas_kernels" "$SITE/sparsejax/pallas_kernels"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/train.log"
"$PY" -m sparsejax.train.pretrain --out "$OUT/retrieval-tiny" --size default --minutes 6 \
  --seed 0 --checkpoint-dir /tmp/retrieval-tiny-ckpt --checkpoint-every 1000 \
  --log-every 100 2>&1 | tee -a "$OUT/train.log"
ls -l "$OUT/retrieval-tiny" | tee -a "$OUT/train.log"
