#!/usr/bin/env bash
# The test command (README): install, build, run every test. GPU tests carry
# the `cuda` marker and run when a GPU and a CUDA build are present. The
# 25 slowest tests are listed at the end, to keep CI time in view.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q --durations=25 tests "$@"
