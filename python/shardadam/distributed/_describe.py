"""The engine's repr: its groups, shards, transports, hyperparameters and options."""
from __future__ import annotations

import torch.distributed as dist

from .._groups import plain_value

__all__ = ["describe"]


def describe(opt) -> str:
    """What ShardedOptimizer.__repr__ shows of the optimizer `opt`."""
    def group_name(g, absent: str = "default") -> str:
        return absent if g is None else f"(size {dist.get_world_size(g)}, id {id(g)})"

    options = dict(opt.rule.options(), dtype=opt.dtype, state_dtypes=opt.state_dtypes,
                   grad_sync_dtype=opt.grad_sync_dtype, param_sync_dtype=opt.param_sync_dtype,
                   device=opt.device, average_grad_sync=opt.average_grad_sync,
                   overlap_grad_sync=opt.overlap_grad_sync, overlap_param_sync=opt.overlap_param_sync,
                   bucket_cap_mb=opt.bucket_cap_mb, pipeline_size=opt.pipeline_size,
                   contiguous_param_buffer=opt.contiguous_param_buffer,
                   contiguous_grad_buffer=opt.contiguous_grad_buffer, store_params=opt.store_params,
                   store_param_remainders=opt.store_param_remainders,
                   with_scaled_states=opt.with_scaled_states, nccl_ub=opt.nccl_ub, capturable=opt.capturable,
                   grad_sync_copy_engine=opt.grad_sync_copy_engine,
                   param_sync_copy_engine=opt.param_sync_copy_engine, state_device=opt.state_device,
                   host_step_in_backward=opt.host_step_in_backward)
    lines = [f"{type(opt).__name__} (world_size={opt.world_size}, shard_rank={opt.rank}, "
             f"process_group={group_name(opt.group)}, "
             f"distributed_process_group={group_name(opt.dist_group)}, "
             f"redundant_process_group={group_name(opt.redundant_group, 'None')}, "
             f"buckets={len(opt.layout.buckets)}, shard_size={opt.shard_size}, "
             f"grad_sync={opt._grad_sync.transport.name}, param_sync={opt._param_sync.transport.name}"]
    for i, g in enumerate(opt.param_groups):
        values = ", ".join(f"{k}={plain_value(g[k])}" for k in opt.rule.group_keys + ("step",))
        lines.append(f"  group {i}: {len(g['params'])} params, {values}")
    lines.append("  options: " + ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in options.items()))
    return "\n".join(lines + [")"])
