#!/usr/bin/env bash
# The default drafters for SmolLM2-135M-Instruct, end to end (each stage resumes; stages 1–21 ran on
# this CPU, stages 22–26 and 28 on lent GPUs):
#   1. self-distil conversations with the target (HumanEval-train, OpenAI-evals questions,
#      self-instruct questions written by the target; held-out chat/code prompts go to eval only);
#   2. train the EAGLE-3 head (the default) in twenty-seven stages — stage 1 and 2 on runs/sd, stage 3 on
#      runs/sd2 (runs/sd extended with more evals and self-instruct questions), stages 4–7 on
#      runs/sd3 (extended again; stages 6 and 7 pack several conversations per row, stage 7
#      rebuilds the draft vocabulary at 8192 tokens), stage 8 on sd4 (stored in the repository;
#      bf16 compute), stage 9 on sd4 + sd5 (stored too), stages 10 and 11 add sd6 and sd7
#      (LowpDense: bf16 products on the CPU's matrix units), stages 12 and 13 add sd8 and sd9, stage
#      14 sd10 + sd11, stage 15 sd12, sd13 and code1 (code requests), stage 16 code2 and code3, stage 17
#      sd14, stage 18 sd15 (stage 19, not packaged, replays four sets beside sd16), stage 20 sd17 +
#      sd18 on a 12288-token vocabulary, stage 21 sd19, stage 22 (1000 steps of 64 rows on a GPU)
#      every set plus sd20a, stage 23 (1988 steps on a GPU) every set up to sd21, stage 24 (3010 steps
#      on a GPU) every set up to sd22, stage 25 (3325) every set up to sd24, stage 26 (2142 steps on
#      a GPU) every set up to sd26, stage 28 (the packaged head: 3290 steps on a GPU) every set up to
#      sd27 (stage 27, a CPU stage on sd27, was not packaged and is not in this chain)
#      — and an EAGLE-1 head in four stages: on runs/sd, then (stages 2 to 4) on every stored set (offline
#      features for EAGLE-3 on the CPU, online for EAGLE-1 and for stages 22–28);
#   3. export both in the released EAGLE layout (float16) into eagle_jax/assets/drafters/.
# Rerun the same command after an interruption: every stage continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
python -m eagle_jax.training.selfdistill --out runs/sd --max-new-tokens 256 --batch-size 8 \
  --sources humaneval,evals,self-instruct --evals-per-subset 6 --self-instruct-n 250
train/cpu.sh configs/train/smollm2_eagle3_cpu.json "$@"
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage2.json "$@"
[[ -d runs/sd2 ]] || cp -r runs/sd runs/sd2
python -m eagle_jax.training.selfdistill --out runs/sd2 --max-new-tokens 256 --batch-size 8 \
  --sources humaneval,evals,self-instruct --evals-per-subset 15 --self-instruct-n 600
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage3.json "$@"
[[ -d runs/sd3 ]] || cp -r runs/sd2 runs/sd3
python -m eagle_jax.training.selfdistill --out runs/sd3 --max-new-tokens 256 --batch-size 8 \
  --sources humaneval,evals,self-instruct --evals-per-subset 30 --self-instruct-n 1500
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage4.json "$@"
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage5.json "$@"
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage6.json "$@"
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage7.json "$@"
# sd4 (stored in the repository, train/data/*.jsonl.gz, so later sessions need not regenerate it):
# new OpenAI-evals questions (the 30 after sd3's per eval), 1000 new self-instruct questions (seed 4,
# 49 more seed topics) and HumanEval-train, replies by continuous batching; the held-out replies
# alone (--limit 0) give train/data/heldout.jsonl.gz. Stage 8 trains the stage-7 head on it.
python -m eagle_jax.training.selfdistill --out runs/sd4 --max-new-tokens 256 --batch-size 16 \
  --sources evals,self-instruct --evals-per-subset 30 --evals-skip 30 --self-instruct-n 1000 --seed 4 --no-eval
python -m eagle_jax.training.selfdistill --out runs/sd4c --max-new-tokens 256 --batch-size 16 \
  --sources humaneval --seed 4 --no-eval
python -m eagle_jax.training.selfdistill --out runs/sd4h --max-new-tokens 256 --batch-size 16 \
  --sources humaneval --limit 0 --seed 4
mkdir -p train/data
[[ -f train/data/sd4.jsonl.gz ]] || cat runs/sd4/train.jsonl runs/sd4c/train.jsonl | gzip -9 > train/data/sd4.jsonl.gz
[[ -f train/data/heldout.jsonl.gz ]] || gzip -9 -c runs/sd4h/eval.jsonl > train/data/heldout.jsonl.gz
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage8.json "$@"
# sd5 (stored as well): 700 new self-instruct questions (seed 5) and the OpenAI-evals questions after
# sd4's (--evals-skip 60); ids already in sd4 are dropped. Stage 9 trains the stage-8 head on sd4 + sd5.
python -m eagle_jax.training.selfdistill --out runs/sd5 --max-new-tokens 256 --batch-size 16 \
  --sources evals,self-instruct --evals-per-subset 40 --evals-skip 60 --self-instruct-n 700 --seed 5 --no-eval
store_new() {  # store_new NAME: runs/NAME/train.jsonl → train/data/NAME.jsonl.gz, minus ids stored already
  [[ -f "train/data/$1.jsonl.gz" ]] || python - "$1" <<'PY'
import gzip, json, sys
from eagle_jax.training.selfdistill import stored_ids
name = sys.argv[1]
seen = stored_ids(["train/data/*.jsonl.gz"])
rows = [l for l in open(f"runs/{name}/train.jsonl") if json.loads(l)["id"] not in seen]
with gzip.open(f"train/data/{name}.jsonl.gz", "wt") as f:
    f.writelines(rows)
PY
}
store_new sd5
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage9.json "$@"
# sd6 … sd9 (stored): new self-instruct questions written by the target, one seed per set (ids an
# earlier set already has are dropped). Each stage trains the previous stage's head on every stored
# set so far: stage 10 on sd4 … sd6, stage 11 adds sd7, stage 12 sd8, stage 13 sd9, stage 14 sd10
# and sd11, stage 15 sd12, sd13 and code1, stage 16 code2 and code3, stage 17 sd14, stage 18 (the
# packaged head) sd15; stages 12 … 18 share one packed feature store (runs/features-eagle3-sd4-sd8:
# each computes only the examples whose tokens it does not hold yet).
self_instruct_set() {  # self_instruct_set NAME N SEED [FLAG …]: N new self-instruct conversations, stored
  python -m eagle_jax.training.selfdistill --out "runs/$1" --sources self-instruct --self-instruct-n "$2" \
    --seed "$3" --batch-size 8 --no-eval "${@:4}"
  store_new "$1"
}
self_instruct_set sd6 700 6
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage10.json "$@"
self_instruct_set sd7 1000 7
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage11.json "$@"
self_instruct_set sd8 1000 8
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage12.json "$@"
self_instruct_set sd9 1000 9
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage13.json "$@"
self_instruct_set sd10 500 10
self_instruct_set sd11 1000 11
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage14.json "$@"
self_instruct_set sd12 400 12
self_instruct_set sd13 600 13
# code1 (stored): HumanEval-style requests for 800 standard-library functions and methods (the
# held-out code prompts' form; training/code_prompts.py), the target's replies. Stage 15 trains
# stage 14's head on sd4 … sd13 and code1.
python -m eagle_jax.training.selfdistill --out runs/code1 --sources stdlib-code --stdlib-code-n 800 --seed 1 \
  --batch-size 8 --no-eval
store_new code1
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage15.json "$@"
# code2 and code3 (stored): 800 more standard-library functions, chosen among those no stored set
# has; then the rest of the standard library and 700 documented functions of installed packages
# (package-code). Stage 16 trains stage 15's head on sd4 … sd13 and code1 … code3.
python -m eagle_jax.training.selfdistill --out runs/code2 --sources stdlib-code --stdlib-code-n 800 --seed 2 \
  --exclude-ids-from 'train/data/*.jsonl.gz' --batch-size 8 --no-eval
store_new code2
python -m eagle_jax.training.selfdistill --out runs/code3 --sources stdlib-code,package-code --stdlib-code-n 1000 \
  --package-code-n 700 --seed 3 --exclude-ids-from 'train/data/*.jsonl.gz' --batch-size 8 --no-eval
store_new code3
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage16.json "$@"
# sd14 (stored): new self-instruct questions (chat), since stage 16's code data moved code tau but
# not chat. Stage 17 trains stage 16's head on every stored set, sd14 last (the feature store
# is extended at its end), with a longer, lower warm-up.
self_instruct_set sd14 800 14
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage17.json "$@"
# sd15 (stored): chat again (self-instruct, seed 15); chat tau had not moved since stage 15. Stage 18
# trains stage 17's head on every stored set for 1000 steps.
self_instruct_set sd15 800 15
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage18.json "$@"
# sd16 (stored): self-instruct questions about the second topic list (--seed-topics more: 392 topics
# no earlier set used; sd4 … sd15 all drew on the first list's 144). Stage 19 trains stage 18's head
# on sd16 with a replay of sd14, sd15, code2 and code3, in a feature store of its own.
self_instruct_set sd16 800 16 --seed-topics more
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage19.json "$@"  # held-out: a wash with stage 18, which stays packaged
# Two probes beside stage 19, each its run with one change; neither is packaged, so the recipe does
# not run them (train/README): 19g learns (p_target + onehot(target argmax)) / 2, 19w widens the MLP
# to 3072 units (stopped at step 380).
#   train/cpu.sh configs/train/smollm2_eagle3_cpu_stage19g.json
#   train/cpu.sh configs/train/smollm2_eagle3_cpu_stage19w.json --set train.stop_at_step=380
# sd17 (stored): more self-instruct questions about the second topic list (seed 17), for a later stage.
self_instruct_set sd17 800 17 --seed-topics more
# sd18 (stored): self-instruct questions about both topic lists (seed 18). Stage 20 trains stage 19's head
# on stage 19's sets, sd17 and sd18, moved onto a 12288-token draft vocabulary rebuilt from them.
self_instruct_set sd18 1200 18 --seed-topics default,more
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage20.json "$@"
# sd19 (stored): 1500 more self-instruct questions about both topic lists (seed 19). Stage 21 trains
# stage 20's head (its 12288-token vocabulary kept) on stage 20's sets and sd19.
self_instruct_set sd19 1500 19 --seed-topics default,more
train/cpu.sh configs/train/smollm2_eagle3_cpu_stage21.json "$@"
# sd20 (stored): 11807 self-instruct conversations about both topic lists (seed 20), written on a lent
# H200 at stop 38 by train/gpu.sh's first step (whole batches of 512; the first 694, sd20a, by
# continuous batching before a time box stopped it, the other 11113, sd20b, by a rerun with
# --no-continuous). Stage 22 trains stage 21's head on every earlier set plus sd20a: 1000 steps of
# 64 rows, target features online. It took 127 s on the H200. JAX picks the GPU where there is one;
# on this CPU the same command resumes from its checkpoints and would need most of a day (an
# estimate from the CPU stages' step times, not a run).
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage22.json "$@"
# sd21 and sd22 (stored): self-instruct conversations (seeds 21 and 22) written on a lent H200 at stop
# 41 by train/gpu.sh. Stage 23 trains stage 22's head on every set up to sd21: a cosine over 1988
# steps of 64 rows, 252 s on the H200 (on this CPU about twice stage 22's time, resumable).
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage23.json "$@"
# Stage 24 (stop 44, on a lent H200 by `train/gpu.sh OUT 0 0`: no new set in the box) trains stage 23's
# head on every set up to sd22: a cosine over 3010 steps of 64 rows, 383 s on the H200 (434 s a step
# on the 2-core AVX2 VM, measured over two steps: about 15 days; train/README.md). sd24 (stored;
# seed 24, written in the same session; there is no sd23) waits for the next stage.
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage24.json "$@"
# Stage 25 (stop 50, on a lent H200 by `train/gpu.sh OUT 0 0` again) trains stage 24's head on every stored
# set, sd24 included (48598 conversations): a cosine over 3325 steps of 64 rows, 424 s on the H200.
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage25.json "$@"
# sd26 and sd27 (stored; seeds 26 and 27): self-instruct conversations written on a lent H200 at stop 51 by
# train/gpu.sh's first step. Stage 26 (`train/gpu.sh OUT 160 0`) trains stage 25's head on every set up to
# sd26 (54742 conversations): a cosine over 2142 steps of 64 rows, 274 s on the H200.
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage26.json "$@"
# Stage 28 (the packaged head; stop 74, `train/gpu.sh OUT 0 0` on a lent H200) trains stage 26's head on every
# set up to sd27 (65956 conversations): a cosine over 3290 steps of 64 rows, 417 s on the H200. sd28 (stored;
# seed 28, written in the same session) waits for the next stage.
python -m eagle_jax.train --config configs/train/smollm2_eagle3_stage28.json "$@"
train/cpu.sh configs/train/smollm2_eagle1_cpu.json "$@"
# The EAGLE-1 head, stage 2 (stop 46, this CPU: the 2-core AVX2 VM): stage 1's head on every stored set,
# sd24 included (48598 conversations, packed), target features online, a 220-step cosine (26 s a step).
train/cpu.sh configs/train/smollm2_eagle1_cpu_stage2.json "$@"
# Stage 3 (stop 47, this CPU: the 2-core Intel Xeon VM, AVX-512): stage 2's head on every stored set again,
# a new seed (mostly rows stage 2 did not reach), another 220-step cosine (10 s a step there).
train/cpu.sh configs/train/smollm2_eagle1_cpu_stage3.json "$@"
# Stage 4 (stop 48, the same kind of Xeon VM): stage 3's head, again every stored set, a new seed, a 220-step
# cosine (about 10 s a step there).
train/cpu.sh configs/train/smollm2_eagle1_cpu_stage4.json "$@"
dest=eagle_jax/assets/drafters
mkdir -p "$dest"
rm -rf "$dest/smollm2-135m-instruct-eagle3" "$dest/smollm2-135m-instruct-eagle1"
cp -r runs/eagle3-stage28/export "$dest/smollm2-135m-instruct-eagle3"
cp -r runs/eagle1-stage4/export "$dest/smollm2-135m-instruct-eagle1"
