#!/usr/bin/env bash
# More data and more training for the default EAGLE-3 drafter on one GPU, inside a time box:
#   1. self-distil new self-instruct conversations with the target (whole batches of 512 rows:
#      on an H200 24k reply tokens/s, against 1.3k for continuous batching's row-by-row refills;
#      questions written 512 at a time; ids already in train/data are left out; held-out prompts
#      are filtered as always) for at most GEN_SECONDS; the replies written by then are kept;
#   2. train the packaged head on every stored set plus the new one (stage 28's config,
#      configs/train/smollm2_eagle3_stage28.json, its sets and every other train/data/*.jsonl.gz but
#      the held-out one, for STEPS steps: target features online, 7.9 steps a second on an H200) for
#      at most TRAIN_SECONDS, then export it.
#
#   train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS] [--set section.key=value ...]
#   (GEN_SECONDS=0 skips step 1: training on the stored sets alone)
#   (environment: SEED=29 (sd28 is stored and untrained; seed 29 writes a new sd29), N=12000 questions asked for,
#    ROWS=512 replies decoded at once, QROWS=512, STEPS=1500 training steps of 64 rows,
#    GEN_PRECISION=highest: the target generates with float32 products, not TF32,
#    TOTAL_SECONDS: a box for the whole script; training then gets what generation left of it, less
#    TRAIN_OVERHEAD=100 s for loading, compiling, saving and export, and STEPS=auto sizes the cosine to
#    that time at STEPS_PER_SECOND=7 (an H200 made 7.9))
#
# OUT_DIR gets sd<SEED>/ (generated.jsonl, train.jsonl, summary.json) and eagle3-gpu/ (metrics,
# checkpoints, export/). Rerunning the same command continues both steps where they stopped (with
# STEPS=auto, the rerun keeps the first run's cosine: it reads total_steps from eagle3-gpu/config.json).
# Lent H200s ran it at stop 38 (stage 22) and at stop 41 (stage 23: TOTAL_SECONDS=550 TRAIN_OVERHEAD=120
# SEED=21 N=6000 STEPS=auto train/gpu.sh OUT 160 0 --set train.save_every=500; train/README.md) and at
# stop 44 (stage 24: the same with GEN_SECONDS=0, every step of the box on the stored sets) and at stop 50
# (stage 25: TOTAL_SECONDS=575 TRAIN_OVERHEAD=100 STEPS=auto train/gpu.sh OUT 0 0 --set train.save_every=500)
# and at stop 51 (stage 26: SEED=26 TOTAL_SECONDS=568 TRAIN_OVERHEAD=100 STEPS=auto train/gpu.sh OUT 160 0, then
# sd27 in a second call: the self-distillation command below with --seed 27 under `timeout 150`) and at stop 74
# (stage 28: SEED=28 TOTAL_SECONDS=570 TRAIN_OVERHEAD=100 STEPS=auto train/gpu.sh OUT 0 0, then sd28 in a second
# call under `timeout 140`; train/README.md says how the GGUF and the wheels got there).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:?usage: train/gpu.sh OUT_DIR [GEN_SECONDS] [TRAIN_SECONDS]}
GEN_SECONDS=${2:-240}
TRAIN_SECONDS=${3:-240}
SEED=${SEED:-29}
N=${N:-12000}
ROWS=${ROWS:-512}
QROWS=${QROWS:-512}
STEPS=${STEPS:-1500}  # stage 22's lesson: steps bought more than new data (train/README.md)
T0=$SECONDS
EXTRA=("${@:4}")  # more --set overrides for the training run
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
mkdir -p "$OUT"
SD="$OUT/sd$SEED"

status=0
if (( GEN_SECONDS > 0 )); then
  JAX_DEFAULT_MATMUL_PRECISION=${GEN_PRECISION:-highest} timeout "$GEN_SECONDS" \
    python3 -m eagle_jax.training.selfdistill --out "$SD" --sources self-instruct \
    --self-instruct-n "$N" --self-instruct-batch-size "$QROWS" --seed "$SEED" --seed-topics default,more \
    --batch-size "$ROWS" --no-continuous --max-new-tokens 256 --no-eval \
    --exclude-ids-from 'train/data/*.jsonl.gz' || status=$?
  [[ $status -eq 124 ]] && echo "[gpu.sh] self-distillation stopped after ${GEN_SECONDS}s; its replies are kept" >&2
  [[ $status -ne 0 && $status -ne 124 ]] && exit "$status"
  python3 -m eagle_jax.training.selfdistill --out "$SD" --splits-only
  NEW_SET=("$SD/train.jsonl")
else  # GEN_SECONDS=0: no new set; train on the stored ones (`timeout 0` would never stop)
  echo "[gpu.sh] GEN_SECONDS=0: no self-distillation, training on the stored sets only" >&2
  NEW_SET=()
fi
if [[ -n ${TOTAL_SECONDS:-} ]]; then
  TRAIN_SECONDS=$(( TOTAL_SECONDS - (SECONDS - T0) - ${TRAIN_OVERHEAD:-100} ))
  (( TRAIN_SECONDS >= 30 )) || { echo "[gpu.sh] TOTAL_SECONDS=$TOTAL_SECONDS leaves no time to train" >&2; exit 1; }
fi
RUN_CONFIG="$OUT/eagle3-gpu/config.json"  # written by the first run: a rerun resumes its schedule
if [[ $STEPS == auto && -f $RUN_CONFIG ]]; then
  STEPS=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["total_steps"])' "$RUN_CONFIG")
  echo "[gpu.sh] resuming $RUN_CONFIG: its cosine over $STEPS steps" >&2
fi
[[ $STEPS == auto ]] && STEPS=$(( TRAIN_SECONDS * ${STEPS_PER_SECOND:-7} ))
echo "[gpu.sh] training for at most ${TRAIN_SECONDS}s, a cosine over $STEPS steps" >&2

BASE=configs/train/smollm2_eagle3_stage28.json
TRAIN_FILES=$(python3 - "$BASE" ${NEW_SET[@]+"${NEW_SET[@]}"} <<'PY'
import glob, json, sys
cfg = json.load(open(sys.argv[1]))
files = cfg["data"]["train"]
stored = [f for f in sorted(glob.glob("train/data/*.jsonl.gz")) if f not in files and f != cfg["data"]["eval"]]
print(json.dumps(files + stored + sys.argv[2:]))
PY
)
python3 -m eagle_jax.train --config "$BASE" \
  --set "model.init_from=\"eagle_jax/assets/drafters/smollm2-135m-instruct-eagle3\"" --set "train.seed=$SEED" \
  --set "data.train=$TRAIN_FILES" --set "train.max_seconds=$TRAIN_SECONDS" --set train.save_every=500 \
  --set train.stop_at_step=null --set "train.total_steps=$STEPS" \
  --set "train.output_dir=\"$OUT/eagle3-gpu\"" --set "export.path=\"$OUT/eagle3-gpu/export\"" ${EXTRA[@]+"${EXTRA[@]}"}
