#!/usr/bin/env bash
# More data and more training for the default EAGLE-3 drafter on one GPU, inside a time box:
#   1. self-distil new self-instruct conversations with the target (continuous batching, 256 rows;
#      questions written 512 at a time; ids already in train/data are left out; held-out prompts
#      are filtered as always) for at most GEN_SECONDS; the replies written by then are kept;
#   2. train the packaged head on every stored set plus the new one (configs/train/smollm2_eagle3_gpu.json,
#      target features online) for at most TRAIN_SECONDS, then export it.
#
#   train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS] [--set section.key=value ...]
#   (environment: SEED=20, N=12000 questions asked for, ROWS=256 replies decoded at once, QROWS=512,
#    GEN_PRECISION=highest: the target generates with float32 products, not TF32)
#
# OUT_DIR gets sd<SEED>/ (generated.jsonl, train.jsonl, summary.json) and eagle3-gpu/ (metrics,
# checkpoints, export/). Rerunning the same command continues both steps where they stopped.
# The stop-38 session ran it on a lent H200 (train/README.md, "GPU stage").
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS]}
GEN_SECONDS=${2:-240}
TRAIN_SECONDS=${3:-240}
SEED=${SEED:-20}
N=${N:-12000}
ROWS=${ROWS:-256}
QROWS=${QROWS:-512}
EXTRA=("${@:4}")  # more --set overrides for the training run
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
mkdir -p "$OUT"
SD="$OUT/sd$SEED"

status=0
JAX_DEFAULT_MATMUL_PRECISION=${GEN_PRECISION:-highest} timeout "$GEN_SECONDS" python3 -m eagle_jax.training.selfdistill --out "$SD" --sources self-instruct \
  --self-instruct-n "$N" --self-instruct-batch-size "$QROWS" --seed "$SEED" --seed-topics default,more \
  --batch-size "$ROWS" --steps-per-call 32 --max-new-tokens 256 --no-eval \
  --exclude-ids-from 'train/data/*.jsonl.gz' || status=$?
[[ $status -eq 124 ]] && echo "[gpu.sh] self-distillation stopped after ${GEN_SECONDS}s; its replies so far are kept" >&2
[[ $status -ne 0 && $status -ne 124 ]] && exit "$status"
python3 -m eagle_jax.training.selfdistill --out "$SD" --splits-only

TRAIN_FILES=$(python3 - "$SD/train.jsonl" <<'PY'
import json, sys
cfg = json.load(open("configs/train/smollm2_eagle3_gpu.json"))
print(json.dumps(cfg["data"]["train"] + [sys.argv[1]]))
PY
)
python3 -m eagle_jax.train --config configs/train/smollm2_eagle3_gpu.json \
  --set "data.train=$TRAIN_FILES" --set "train.max_seconds=$TRAIN_SECONDS" \
  --set "train.output_dir=\"$OUT/eagle3-gpu\"" --set "export.path=\"$OUT/eagle3-gpu/export\"" ${EXTRA[@]+"${EXTRA[@]}"}
