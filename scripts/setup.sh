#!/usr/bin/env bash
# Idempotent set-up: creates .venv (if missing) and installs dsx3d with the exact versions CI uses.
# A stamp holding the hash of setup.cfg and scripts/constraints.txt makes a second run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.dsx3d-setup-stamp
want=$(cat setup.cfg pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned dependencies into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip==26.3 setuptools==84.2.1 wheel==0.48.0
  .venv/bin/python -m pip install -q -c scripts/constraints.txt --no-build-isolation -e ".[dev]"
  echo "$want" > "$stamp"
else
  echo "[setup] .venv is up to date" >&2
fi
