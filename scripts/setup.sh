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
# Debian's chromium for the dashboard's headless-browser test (tests/server/test_dashboard_browser.py,
# driven by Playwright's Python package with executable_path=/usr/bin/chromium). Only where apt works:
# elsewhere that test skips, saying so.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium with apt; the dashboard browser test will skip" >&2
fi
# Build the C++ CPU attention kernels now (once per machine, about 20 s) rather than at first use.
python -m tokenmill.kernels.cpu.build || echo "setup: the CPU attention kernels did not build (see above); tokenmill will use the slower torch attention backend" >&2
