#!/usr/bin/env bash
# The main job (README): install, build, then a real distributed training run:
# a small GPT on Python source text, trained by 2 processes (torchrun) with
# shardadam.DistributedFusedAdam and checked against DDP + torch.optim.AdamW.
# CPU and gloo by default; pass --device cuda [--bf16] for NCCL, one GPU per
# process. Writes the loss log and the loss curves to examples/out/ (--out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# One thread per process (train.py sets it too); exporting it also keeps
# torchrun from warning that it chose this for us.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
torchrun --standalone --nproc_per_node 2 examples/train.py "$@"
