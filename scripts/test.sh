#!/usr/bin/env bash
# Quick start: set up, lint, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Tests only (serve.sh installs no browser): Debian's chromium for the dashboard's headless-browser test (tests/server/test_dashboard_browser.py,
# driven by Playwright's Python package with executable_path=/usr/bin/chromium). Only where apt works:
# elsewhere that test skips, saying so.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium with apt; the dashboard browser test will skip" >&2
fi
. .venv/bin/activate
ruff check src tests
python -m pytest -q "$@"
