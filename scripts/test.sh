#!/usr/bin/env bash
# Quick start: set up, lint, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests
python -m pytest -q "$@"
