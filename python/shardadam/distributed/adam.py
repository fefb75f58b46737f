"""DistributedFusedAdam: apex's constructor on the ZeRO-2 engine with the Adam rule."""
from __future__ import annotations

import torch

from .._rules import AdamRule
from . import _watchdog
from .optimizer import ShardedOptimizer

__all__ = ["DistributedFusedAdam"]


class DistributedFusedAdam(ShardedOptimizer):
    """ZeRO-2 Adam/AdamW with sharded state, on NCCL (GPU) or gloo (CPU).

    apex's constructor, with apex's meanings (README, "apex's arguments and
    methods"): adam_w_mode=False is Adam with L2 weight decay, amsgrad keeps
    max_exp_avg_sq; bf16_stochastic_round / stochastic_round_seed (bf16
    parameter shards that are their own master, rounded stochastically:
    _rounding.py); exp_avg_dtype / exp_avg_sq_dtype (a state's storage of
    its own, FP8 E4M3 included, with a scale per shard fragment:
    _options.state_dtypes); dtype, store_params, store_param_remainders,
    with_scaled_states and nccl_ub as distributed/_options.py and _nccl_ub.py
    say; state_device="cpu" keeps this rank's shard of the masters and states
    in host memory, stepped there by the CPU engine ([Note: host shards] in
    distributed/_host_shards.py), and host_step_in_backward=True steps it
    during backward, bucket by bucket as the reduce-scatters end ([Note: host
    step in backward] there); every other argument is the engine's
    (distributed/optimizer.py).
    With average_grad_sync=True the result equals
    DDP + torch.optim.AdamW (torch.optim.Adam with adam_w_mode=False) on the
    same global batch.

    Every rank builds the same model and passes the same parameters; they are
    broadcast from rank 0 of ``process_group`` here. A trainable parameter that
    received no gradient on a rank contributes zeros to the reduction, and every
    trainable parameter is updated every step (weight decay and moments apply),
    as in apex; frozen parameters (requires_grad=False) are never touched.

    With overlap_grad_sync=True a parameter's ``.grad`` is handed to the
    optimizer as soon as backward produces it and is then None: read
    gradients through grad_norm() / clip_grad_norm(). Inside no_sync(),
    gradients accumulate in ``.grad`` as usual.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, dtype=torch.float32, grad_sync_dtype=None, param_sync_dtype=None,
                 device=None, process_group=None, distributed_process_group=None, redundant_process_group=None,
                 average_grad_sync=True, overlap_grad_sync=True, overlap_param_sync=False, bucket_cap_mb=100,
                 pipeline_size=2, contiguous_param_buffer=False, contiguous_grad_buffer=False, store_params=None,
                 store_param_remainders=False, with_scaled_states=False, nccl_ub=False, capturable=False,
                 grad_sync_copy_engine=None, param_sync_copy_engine=None, skip_nonfinite_grads=False,
                 copy_engine_timeout=_watchdog.DEFAULT_TIMEOUT_S, bf16_stochastic_round=False,
                 stochastic_round_seed=None, exp_avg_dtype=None, exp_avg_sq_dtype=None, state_device=None,
                 host_step_in_backward=False):
        self.adam_w_mode = adam_w_mode
        self.amsgrad = amsgrad
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(
            params, defaults, AdamRule(adam_w_mode, amsgrad), dtype=dtype, grad_sync_dtype=grad_sync_dtype,
            param_sync_dtype=param_sync_dtype, device=device, process_group=process_group,
            distributed_process_group=distributed_process_group, redundant_process_group=redundant_process_group,
            average_grad_sync=average_grad_sync, overlap_grad_sync=overlap_grad_sync,
            overlap_param_sync=overlap_param_sync, bucket_cap_mb=bucket_cap_mb, pipeline_size=pipeline_size,
            contiguous_param_buffer=contiguous_param_buffer, contiguous_grad_buffer=contiguous_grad_buffer,
            store_params=store_params, store_param_remainders=store_param_remainders,
            with_scaled_states=with_scaled_states, nccl_ub=nccl_ub, capturable=capturable,
            grad_sync_copy_engine=grad_sync_copy_engine, param_sync_copy_engine=param_sync_copy_engine,
            skip_nonfinite_grads=skip_nonfinite_grads, copy_engine_timeout=copy_engine_timeout,
            bf16_stochastic_round=bf16_stochastic_round, stochastic_round_seed=stochastic_round_seed,
            exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, state_device=state_device,
            host_step_in_backward=host_step_in_backward)
