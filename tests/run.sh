#!/usr/bin/env bash
# The test command (README): install, build, run every test. GPU tests carry
# the `cuda` marker and run when a GPU and a CUDA build are present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q tests "$@"
