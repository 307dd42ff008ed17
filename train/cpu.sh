#!/usr/bin/env bash
# Train on this machine's CPU.
#
#   train/cpu.sh [CONFIG] [--set section.key=value ...]
#   DEVICES=8 MESH='[2,2,2]' train/cpu.sh configs/train/toy.json
#
# DEVICES=N splits the CPU into N virtual XLA devices, so the sharded path (a data×fsdp×tensor
# mesh, NamedSharding in/out, collectives) runs as it would on an accelerator slice; useful to
# check a mesh before renting one, not for speed. MESH overrides train.mesh (one entry may be -1).
# Rerunning the same command resumes from the newest checkpoint in the run's output directory.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${1:-configs/train/toy.json}
[[ $# -gt 0 ]] && shift
DEVICES=${DEVICES:-1}

export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${DEVICES}"
export EAGLE_JAX_DISTRIBUTED=0  # one process, whatever the environment says

args=()
if [[ -n "${MESH:-}" ]]; then
  args+=(--set "train.mesh=${MESH}")
fi
exec python -m eagle_jax.train --config "$CONFIG" ${args[@]+"${args[@]}"} "$@"
