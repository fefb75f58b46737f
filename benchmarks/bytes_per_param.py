"""Optimizer memory per parameter for every DistributedFusedAdam storage mode.

Counts, on each rank, the bytes of the tensors the optimizer owns between
steps (sharded states, remainders, scales, gradient and parameter shards,
persistent buffers), divided by the model's parameter count; the model's own
parameters and gradients are not counted unless they live in the optimizer's
contiguous buffers (reported separately). Exact counts, no timing: runs on
CPU with gloo.

    torchrun --nproc_per_node 2 benchmarks/bytes_per_param.py
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import shardadam
from shardadam.distributed import BucketRows

CONFIGS = {
    "fp32 params, fp32 state": dict(param_dtype=torch.float32),
    "fp32 params, amsgrad": dict(param_dtype=torch.float32, amsgrad=True),
    "bf16 params, fp32 master": dict(param_dtype=torch.bfloat16),
    "bf16 params, remainders": dict(param_dtype=torch.bfloat16, store_param_remainders=True, store_params=False),
    "bf16 params, scaled fp16 states": dict(param_dtype=torch.bfloat16, with_scaled_states=True, dtype=torch.float16),
    "bf16 params, store_params=False": dict(param_dtype=torch.bfloat16, store_params=False),
    "fp32 params, contiguous param + grad buffers": dict(param_dtype=torch.float32, contiguous_param_buffer=True,
                                                        contiguous_grad_buffer=True),
    "fp32 params, contiguous buffers, store_params=True": dict(param_dtype=torch.float32, store_params=True,
                                                              contiguous_param_buffer=True,
                                                              contiguous_grad_buffer=True),
    "fp32 params, contiguous buffers, FP8 states": dict(param_dtype=torch.float32, contiguous_param_buffer=True,
                                                       contiguous_grad_buffer=True, exp_avg_dtype=torch.uint8,
                                                       exp_avg_sq_dtype=torch.uint8),
    "fp32 params, contiguous buffers, 8-bit blockwise states": dict(
        param_dtype=torch.float32, contiguous_param_buffer=True, contiguous_grad_buffer=True,
        exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8),
    "bf16 params, stochastic rounding, 8-bit blockwise states": dict(
        param_dtype=torch.bfloat16, bf16_stochastic_round=True, contiguous_param_buffer=True,
        contiguous_grad_buffer=True, exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8),
    "bf16 params, stochastic rounding, FP8 states": dict(param_dtype=torch.bfloat16, bf16_stochastic_round=True,
                                                        contiguous_param_buffer=True, contiguous_grad_buffer=True,
                                                        exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
}
# Buffers that hold the model's own parameters and gradients (the parameter
# and gradient shards may be views of them: [Note: reduced shards in the
# gradient buffer]).
MODEL_OWNED = ("param_buffer", "grad_buffer")


def _tensors(opt) -> list:
    """(attribute, tensor) for every tensor the optimizer holds."""
    held = [(k, v) for k, v in vars(opt).items() if torch.is_tensor(v)]
    held += [(k, t) for k, v in vars(opt).items() if isinstance(v, BucketRows) for t in v.tensors]
    held += [(f"state:{k}", v) for k, v in getattr(opt, "states", {}).items()]
    held += [(f"blocks:{k}", t) for k, views in getattr(opt, "state_blocks", {}).items() for t in views]
    return held + [(f"scale:{k}", v) for k, v in getattr(opt, "state_scales", {}).items()]


def owned_bytes(opt) -> tuple[int, int]:
    """(optimizer-only bytes, bytes of buffers holding the model's params/grads),
    each storage counted once: shards that are views of the master or of a
    contiguous buffer add nothing."""
    model_storages, own, model = set(), 0, 0
    for name, t in _tensors(opt):
        if name in MODEL_OWNED and t.untyped_storage().data_ptr() not in model_storages:
            model_storages.add(t.untyped_storage().data_ptr())
            model += t.untyped_storage().nbytes()
    seen = set(model_storages)
    for _, t in _tensors(opt):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and t.numel():
            seen.add(storage.data_ptr())
            own += storage.nbytes()
    return own, model


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rows = []
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg)
        dtype = cfg.pop("param_dtype")
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(dtype)
        n = sum(p.numel() for p in model.parameters())
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=1, **cfg)
        own, buffers = owned_bytes(opt)
        rows.append((name, own / n, buffers / n))
        del opt
    if dist.get_rank() == 0:
        print(f"{world} ranks, {n:,} parameters, bucket_cap_mb=1; bytes per parameter on one rank")
        print("| storage | optimizer | buffers holding the model's params/grads |")
        print("|---|---:|---:|")
        for name, own, buffers in rows:
            print(f"| {name} | {own:.2f} | {buffers:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
