#!/usr/bin/env bash
# More data and more training for the default EAGLE-3 drafter on one GPU, inside a time box:
#   1. self-distil new self-instruct conversations with the target (whole batches of 512 rows:
#      on an H200 24k reply tokens/s, against 1.3k for continuous batching's row-by-row refills;
#      questions written 512 at a time; ids already in train/data are left out; held-out prompts
#      are filtered as always) for at most GEN_SECONDS; the replies written by then are kept;
#   2. train the packaged head on every stored set plus the new one (stage 22b's config,
#      configs/train/smollm2_eagle3_stage22b.json, for STEPS steps: target features online, 7.9 steps
#      a second on an H200) for at most TRAIN_SECONDS, then export it.
#
#   train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS] [--set section.key=value ...]
#   (environment: SEED=21 (sd20 is stored), N=12000 questions asked for, ROWS=512 replies decoded at once, QROWS=512,
#    STEPS=1500 training steps of 64 rows,
#    GEN_PRECISION=highest: the target generates with float32 products, not TF32)
#
# OUT_DIR gets sd<SEED>/ (generated.jsonl, train.jsonl, summary.json) and eagle3-gpu/ (metrics,
# checkpoints, export/). Rerunning the same command continues both steps where they stopped.
# The stop-38 session ran its steps on a lent H200 (train/README.md, stage 22).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS]}
GEN_SECONDS=${2:-240}
TRAIN_SECONDS=${3:-240}
SEED=${SEED:-21}
N=${N:-12000}
ROWS=${ROWS:-512}
QROWS=${QROWS:-512}
STEPS=${STEPS:-1500}  # stage 22's lesson: steps bought more than new data (train/README.md)
EXTRA=("${@:4}")  # more --set overrides for the training run
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
mkdir -p "$OUT"
SD="$OUT/sd$SEED"

status=0
JAX_DEFAULT_MATMUL_PRECISION=${GEN_PRECISION:-highest} timeout "$GEN_SECONDS" python3 -m eagle_jax.training.selfdistill --out "$SD" --sources self-instruct \
  --self-instruct-n "$N" --self-instruct-batch-size "$QROWS" --seed "$SEED" --seed-topics default,more \
  --batch-size "$ROWS" --no-continuous --max-new-tokens 256 --no-eval \
  --exclude-ids-from 'train/data/*.jsonl.gz' || status=$?
[[ $status -eq 124 ]] && echo "[gpu.sh] self-distillation stopped after ${GEN_SECONDS}s; its replies so far are kept" >&2
[[ $status -ne 0 && $status -ne 124 ]] && exit "$status"
python3 -m eagle_jax.training.selfdistill --out "$SD" --splits-only

TRAIN_FILES=$(python3 - "$SD/train.jsonl" <<'PY'
import json, sys
cfg = json.load(open("configs/train/smollm2_eagle3_stage22b.json"))
print(json.dumps(cfg["data"]["train"] + [sys.argv[1]]))
PY
)
python3 -m eagle_jax.train --config configs/train/smollm2_eagle3_stage22b.json \
  --set "model.init_from=\"eagle_jax/assets/drafters/smollm2-135m-instruct-eagle3\"" --set "train.seed=$SEED" \
  --set "data.train=$TRAIN_FILES" --set "train.max_seconds=$TRAIN_SECONDS" --set train.save_every=100 \
  --set train.stop_at_step=null --set "train.total_steps=$STEPS" \
  --set "train.output_dir=\"$OUT/eagle3-gpu\"" --set "export.path=\"$OUT/eagle3-gpu/export\"" ${EXTRA[@]+"${EXTRA[@]}"}
