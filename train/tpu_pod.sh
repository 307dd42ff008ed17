#!/usr/bin/env bash
# Train on a Cloud TPU pod slice (v4-32, v5p-64, v6e-64, ...): every host runs the same command.
#
#   TPU_NAME=my-pod ZONE=us-central2-b CKPT=gs://my-bucket/runs/eagle3 \
#     train/tpu_pod.sh configs/train/X.json [--set section.key=value ...]
#   SETUP=1 ...   first copy the repo to every worker and install it (jax[tpu] matching jax==0.10.2)
#
# How the hosts find each other: EAGLE_JAX_DISTRIBUTED=1 makes `python -m eagle_jax.train` call
# jax.distributed.initialize() before touching a device; JAX reads the pod's coordinator, host
# count and host index from the TPU VM metadata. After that jax.devices() lists every chip of the
# slice and the trainer's (data, fsdp, tensor) mesh spans all hosts.
#
# What each host needs:
#   * the same code and config (SETUP=1 copies this checkout to ~/eagle_jax on every worker);
#   * checkpoints on storage all hosts share: every host writes its own shards, so the checkpoint
#     directory must be a bucket (orbax writes gs:// natively), set here with CKPT;
#   * training data readable by every host (each host reads its 1/num_hosts share of the batch).
# Metrics (metrics.jsonl) and plots are written by host 0 only, to OUTPUT_DIR on that worker.
# Rerunning the same command resumes from the newest checkpoint in CKPT.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU VM zone}"
: "${CKPT:?set CKPT to a gs:// checkpoint directory shared by all hosts}"
CONFIG=${1:?usage: train/tpu_pod.sh CONFIG [--set key=value ...]}
shift
REMOTE_DIR=${REMOTE_DIR:-eagle_jax}  # relative to each worker's home directory
OUTPUT_DIR=${OUTPUT_DIR:-runs/$(basename "$CONFIG" .json)}

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=("$TPU_NAME" --zone "$ZONE" ${PROJECT:+--project "$PROJECT"})

if [[ "${SETUP:-0}" == 1 ]]; then
  tarball=$(mktemp -t eagle_jax.XXXXXX.tar.gz)
  git ls-files -z | tar --null -czf "$tarball" -T -
  "${gcloud_tpu[@]}" scp "$tarball" "${where[0]}:eagle_jax.tar.gz" "${where[@]:1}" --worker=all
  "${gcloud_tpu[@]}" ssh "${where[@]}" --worker=all --command "
    set -e; mkdir -p $REMOTE_DIR && tar -xzf eagle_jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR &&
    python3 -m venv .venv && . .venv/bin/activate && pip install -q -e . 'jax[tpu]==0.10.2'"
  rm -f "$tarball"
fi

train_args=$(printf '%q ' --config "$CONFIG" --output-dir "$OUTPUT_DIR" --set "train.checkpoint_dir=\"$CKPT\"" "$@")
"${gcloud_tpu[@]}" ssh "${where[@]}" --worker=all --command "
  cd $REMOTE_DIR && . .venv/bin/activate &&
  EAGLE_JAX_DISTRIBUTED=1 python -m eagle_jax.train $train_args"
