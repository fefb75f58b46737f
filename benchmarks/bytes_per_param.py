"""Optimizer memory per parameter for every DistributedFusedAdam storage mode.

Goal: each mode keeps what its layout promises, 12/N bytes per parameter for
fp32 states and less for the low-bit ones (README, "Memory"). Judged by the
bytes per parameter on one rank of the storages the optimizer owns between
steps, each once; the contiguous buffers, which hold the model's own parameters
and gradients, apart. Exact counts: runs on the CPU with gloo.

    torchrun --nproc_per_node 2 benchmarks/bytes_per_param.py
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import shardadam
from harness import md_table, model_buffer_storages, optimizer_bytes
from models import BLOCKWISE8, FP8

BUFFERS = dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)
CONFIGS = {
    "fp32 params, fp32 state": dict(param_dtype=torch.float32),
    "fp32 params, amsgrad": dict(param_dtype=torch.float32, amsgrad=True),
    "bf16 params, fp32 master": dict(param_dtype=torch.bfloat16),
    "bf16 params, remainders": dict(param_dtype=torch.bfloat16, store_param_remainders=True, store_params=False),
    "bf16 params, scaled fp16 states": dict(param_dtype=torch.bfloat16, with_scaled_states=True, dtype=torch.float16),
    "bf16 params, store_params=False": dict(param_dtype=torch.bfloat16, store_params=False),
    "fp32 params, contiguous param + grad buffers": dict(param_dtype=torch.float32, **BUFFERS),
    "fp32 params, contiguous buffers, store_params=True": dict(param_dtype=torch.float32, store_params=True,
                                                              **BUFFERS),
    "fp32 params, contiguous buffers, FP8 states": dict(param_dtype=torch.float32, **FP8, **BUFFERS),
    "fp32 params, contiguous buffers, 8-bit blockwise states": dict(param_dtype=torch.float32, **BLOCKWISE8,
                                                                   **BUFFERS),
    "bf16 params, stochastic rounding, 8-bit blockwise states": dict(param_dtype=torch.bfloat16,
                                                                    bf16_stochastic_round=True, **BLOCKWISE8, **BUFFERS),
    "bf16 params, stochastic rounding, FP8 states": dict(param_dtype=torch.bfloat16, bf16_stochastic_round=True,
                                                        **FP8, **BUFFERS),
}


def main() -> None:
    dist.init_process_group("gloo")
    rows = []
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg)
        dtype = cfg.pop("param_dtype")
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dtype)
        n = sum(p.numel() for p in model.parameters())
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=1, **cfg)
        # shards that are views of the master or of a contiguous buffer add nothing: each storage counts once
        rows.append([name, f"{optimizer_bytes(opt) / n:.2f}", f"{sum(model_buffer_storages(opt).values()) / n:.2f}"])
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {n:,} parameters, bucket_cap_mb=1; bytes per parameter on one rank")
        print(md_table(["storage", "optimizer", "buffers holding the model's params/grads"], rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
