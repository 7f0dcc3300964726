#!/usr/bin/env bash
# Creates .venv and installs tokenmill into it. torch==2.13.0 goes in first so the project's
# `torch>=` range is already satisfied (any other torch request would pull CUDA builds).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# Build the C++ CPU attention kernels now (once per machine, about 20 s) rather than at first use.
python -m tokenmill.kernels.cpu.build || echo "setup: the CPU attention kernels did not build (see above); tokenmill will use the slower torch attention backend" >&2
