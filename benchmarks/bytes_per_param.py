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
}
# Buffers that hold the model's own parameters and gradients.
MODEL_OWNED = ("param_buffer", "param_shards", "grad_buffer")


def owned_bytes(opt) -> tuple[int, int]:
    """(optimizer-only bytes, bytes of buffers holding the model's params/grads)."""
    seen, own, model = set(), 0, 0
    tensors = [(k, v) for k, v in vars(opt).items() if torch.is_tensor(v)]
    tensors += [(k, t) for k, v in vars(opt).items() if isinstance(v, BucketRows) for t in v.tensors]
    tensors += [(f"state:{k}", v) for k, v in getattr(opt, "states", {}).items()]
    tensors += [(f"scale:{k}", v) for k, v in getattr(opt, "state_scales", {}).items()]
    for name, t in tensors:  # each storage once: the parameter shards are views of the buffer or the master
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not t.numel():
            continue
        seen.add(storage.data_ptr())
        size = storage.nbytes()
        if name == "param_shards" and opt.param_buffer is None:
            own += size  # a shard buffer of its own (unless it is the master, counted once already)
        elif name in MODEL_OWNED:
            model += size
        else:
            own += size
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
