#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check, check the import layers, build the docs (a broken link fails) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
echo "[test] ruff" >&2
ruff check dsx3d tests scripts
echo "[test] mypy" >&2
mypy
echo "[test] lint-imports (the layer contracts in setup.cfg)" >&2
lint-imports
echo "[test] mkdocs build --strict (site/ is gitignored)" >&2
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir site
echo "[test] pytest" >&2
python -m pytest -q --durations=30 "$@"
