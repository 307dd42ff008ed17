#!/usr/bin/env bash
# The default target (SmolLM2-135M-Instruct) with its packaged EAGLE-3 drafter, sized for a small CPU
# host: 2048-token context compiled as two cache buckets, four generations in flight.
#   serve/smollm2_cpu.sh [extra flags, e.g. --method vanilla --port 9000]
set -euo pipefail
exec python -m eagle_jax.serve --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
  --max-cache-len 2048 --cache-buckets 512,2048 --max-active 4 --default-max-tokens 512 \
  --shutdown-timeout 30 "$@"
