#!/usr/bin/env bash
# The main job (README): install, build, then a real training run with
# shardadam.FusedAdam (a small GPT on Python source text), checked against
# torch.optim.AdamW. CPU by default; pass --device cuda [--bf16] for the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 examples/train.py "$@"
