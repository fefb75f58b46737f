"""FusedLion: Lion on the shared fused optimizer (_fused_optimizer.py)."""
from __future__ import annotations

import torch

from ._fused_optimizer import FusedOptimizer
from ._rules import LionRule

__all__ = ["FusedLion"]


class FusedLion(FusedOptimizer):
    """Lion with fused multi-tensor kernels, on CPU and CUDA.

    lion-pytorch's constructor (``Lion(params, lr=1e-4, betas=(0.9, 0.99),
    weight_decay=0.0)``) and update: decoupled weight decay, then
    ``p -= lr * sign(beta1 * exp_avg + (1 - beta1) * grad)``, then
    ``exp_avg = beta2 * exp_avg + (1 - beta2) * grad``. The one state is
    ``exp_avg``. The keyword options are FusedAdam's where they apply:
    maximize, capturable, master_weights / master_weight_dtype,
    exp_avg_dtype (fp32, bf16, fp16 or FP8 E4M3 with per-tensor scales, as
    torch.float8_e4m3fn or TransformerEngine's torch.uint8, or "blockwise8"),
    store_param_remainders, flat_grads, skip_nonfinite_grads.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False, capturable=False,
                 master_weights=False, master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 store_param_remainders=False, flat_grads=False, skip_nonfinite_grads=False,
                 bf16_stochastic_round=False, stochastic_round_seed=None, state_device=None):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, LionRule(), capturable=capturable, master_weights=master_weights,
                         master_weight_dtype=master_weight_dtype, state_dtypes=dict(exp_avg=exp_avg_dtype),
                         store_param_remainders=store_param_remainders, flat_grads=flat_grads,
                         skip_nonfinite_grads=skip_nonfinite_grads, bf16_stochastic_round=bf16_stochastic_round,
                         stochastic_round_seed=stochastic_round_seed, state_device=state_device)
