"""FusedAdam: a torch.optim.Optimizer on the shardadam kernels.

A drop-in replacement for TransformerEngine's and apex's FusedAdam, on CPU and
CUDA: master weights, fp32/bf16/fp16 states (fp16 with per-tensor scales),
bf16 params with int16 remainders, AMSGrad, CUDA-graph capturable steps. The
Adam rule (_rules.py) on the shared fused optimizer (_fused_optimizer.py).
"""
from __future__ import annotations

import torch

from ._fused_optimizer import FusedOptimizer
from ._rules import AdamRule

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizer):
    """Adam / AdamW with fused multi-tensor kernels.

    adam_w_mode=True is torch.optim.AdamW (decoupled weight decay), False is
    torch.optim.Adam with L2 weight decay. Per-group options: lr, betas, eps,
    weight_decay, bias_correction, maximize. The step counter is
    ``param_groups[i]["step"]``: an int that advances on every step() for every
    group (empty groups too), or with ``capturable=True`` a float32 device tensor
    advanced on the device only when the step was applied.

    master_weights: fp16/bf16 params get a master copy in master_weight_dtype
    (fp32, or fp16 kept with a per-tensor scale) in ``state[p]["master_param"]``;
    the param is the master rounded to nearest. store_param_remainders: bf16
    params + int16 remainders instead of an fp32 master (2 bytes per element).
    exp_avg_dtype / exp_avg_sq_dtype: fp32, bf16, or fp16 (per-tensor scales).

    flat_grads=True: gradients live in the optimizer's flat buffers (``p.grad``
    are views into them from the first step); backward accumulates in place,
    zero_grad() zeroes the buffers (set_to_none is ignored) and step() never
    re-points its table. Every parameter then takes a step, with a zero
    gradient if backward gave it none; do not reset or replace gradients by
    other means (model.zero_grad(), p.grad = t: detected at that step, raises).

    skip_nonfinite_grads=True: a step whose gradients hold inf/NaN is skipped
    (nothing written, step counters unchanged) and counted in skipped_steps.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 store_param_remainders=False, maximize=False, flat_grads=False, skip_nonfinite_grads=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults, AdamRule(adam_w_mode, amsgrad), capturable=capturable,
                         master_weights=master_weights, master_weight_dtype=master_weight_dtype,
                         state_dtypes=dict(exp_avg=exp_avg_dtype, exp_avg_sq=exp_avg_sq_dtype),
                         store_param_remainders=store_param_remainders, flat_grads=flat_grads,
                         skip_nonfinite_grads=skip_nonfinite_grads)
