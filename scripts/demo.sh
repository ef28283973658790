#!/usr/bin/env bash
# The embedded demo: set up (idempotent), then train a tiny Llama from scratch with dp 2 x tp 2 x pp 2 on
# 8 local CPU processes, on Python's own documentation with a tokenizer trained on it. A few minutes.
# Extra arguments go to `dsx3d train` (e.g. --resume). Outputs: runs/tiny-llama-3d/ (see docs/guide/training.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
if [ "$#" -eq 0 ]; then
  set -- --overwrite  # a demo starts over; pass --resume to continue an interrupted one instead
fi
dsx3d train recipes/tiny-llama-3d.yaml "$@"
