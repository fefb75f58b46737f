#!/usr/bin/env bash
# The main job (README): install, build, then a real distributed training run:
# a small GPT on Python source text, trained by 2 processes (torchrun) with
# shardadam.DistributedFusedAdam and checked against DDP + torch.optim.AdamW.
# CPU and gloo by default; pass --device cuda [--bf16] for NCCL, one GPU per
# process. Writes the loss log and the loss curves to examples/out/ (--out).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/machine.sh
# Build what this machine can run: with no GPU visible the CUDA kernels would
# never launch, and compiling them (when nvcc is installed) takes minutes; with
# a GPU, only its own architecture. SHARDADAM_CUDA / CMAKE_CUDA_ARCHITECTURES
# set by the caller win.
if [ -z "${SHARDADAM_CUDA:-}" ]; then
  if gpu_visible; then
    export SHARDADAM_CUDA=AUTO
    if [ -z "${CMAKE_CUDA_ARCHITECTURES:-}" ]; then
      CMAKE_CUDA_ARCHITECTURES="$(gpu_architectures)"
      export CMAKE_CUDA_ARCHITECTURES
    fi
  else
    export SHARDADAM_CUDA=OFF
  fi
fi
bash scripts/install.sh
# One thread per process (train.py sets it too); exporting it also keeps
# torchrun from warning that it chose this for us.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
torchrun --standalone --nproc_per_node 2 examples/train.py "$@"
