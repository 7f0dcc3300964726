#!/usr/bin/env bash
# Quick start: set up, then serve the default model on http://127.0.0.1:8000 (extra args go to `tokenmill serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tokenmill serve "$@"
