#!/usr/bin/env bash
# The main job (README): install, build, then benchmark the kernels against
# torch on the CPU, and on the GPU too when one is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
device=cpu
if python3 -c "import torch, shardadam, sys; sys.exit(not (torch.cuda.is_available() and shardadam.build_info()['cuda']))"; then
  device=all
fi
python3 benchmarks/bench_kernels.py --device "$device" "$@"
