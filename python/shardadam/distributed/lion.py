"""DistributedFusedLion: Lion on the ZeRO-2 engine (distributed/optimizer.py)."""
from __future__ import annotations

from .._rules import LionRule
from .optimizer import ShardedOptimizer

__all__ = ["DistributedFusedLion"]


class DistributedFusedLion(ShardedOptimizer):
    """ZeRO-2 Lion: lion-pytorch's ``Lion(params, lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0.0)`` update (see FusedLion) with sharded state, on NCCL
    (GPU) or gloo (CPU). Every keyword option of DistributedFusedAdam's
    engine applies alike (grad_sync_dtype, param_sync_dtype, process groups,
    overlap_grad_sync / overlap_param_sync, bucket_cap_mb, pipeline_size,
    contiguous buffers, dtype, store_params, store_param_remainders,
    with_scaled_states (with dtype=torch.float16: scaled fp16 master and
    exp_avg), nccl_ub, capturable, the copy engines, skip_nonfinite_grads,
    copy_engine_timeout, state_device, host_step_in_backward), as do its
    methods (grad_norm, clip_grad_norm, no_sync, both checkpoint formats). With
    average_grad_sync=True the result equals DDP + Lion on the global batch.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **engine_options):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), LionRule(),
                         **engine_options)
