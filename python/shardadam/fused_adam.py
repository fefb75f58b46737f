"""FusedAdam: a torch.optim.Optimizer on the shardadam kernels.

A drop-in replacement for TransformerEngine's and apex's FusedAdam, on CPU and
CUDA: master weights, fp32/bf16/fp16 states (fp16 with per-tensor scales),
bf16 params with int16 remainders, AMSGrad, CUDA-graph capturable steps,
TE's decoupled gradients and state accessors (_te_apex.py). The Adam rule
(_rules.py) on the shared fused optimizer (_fused_optimizer.py).
"""
from __future__ import annotations

import torch

from . import _te_apex
from ._fused_optimizer import FusedOptimizer
from ._rules import AdamRule
from ._tracked import GRAD, decoupled_grad

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizer):
    """Adam / AdamW with fused multi-tensor kernels.

    Positional arguments: ``params, lr, betas, eps, weight_decay, amsgrad``
    (TransformerEngine's and torch.optim's order); every other option is
    keyword-only. apex's positional order (lr, bias_correction, betas, ...)
    must be given by keyword (a bool in betas' place raises).

    adam_w_mode=True is torch.optim.AdamW (decoupled weight decay), False is
    torch.optim.Adam with L2 weight decay. Per-group options: lr, betas, eps,
    weight_decay, bias_correction, maximize. The step counter is
    ``param_groups[i]["step"]``: an int that advances on every step() for every
    group (empty groups too), or with ``capturable=True`` a float32 device tensor
    advanced on the device only when the step was applied.

    master_weights: fp16/bf16 params get a master copy in master_weight_dtype
    (fp32, or fp16 kept with a per-tensor scale) in ``state[p]["master_param"]``;
    the param is the master rounded to nearest. Given as a list (TE's form),
    one fp32 tensor per parameter in param_groups order: master weights on,
    each master starting from its tensor (a parameter that is its own master,
    fp32 or frozen, must equal it). store_param_remainders: bf16 params + int16
    remainders instead of an fp32 master (2 bytes per element).
    exp_avg_dtype / exp_avg_sq_dtype: fp32, bf16, fp16 (per-tensor scales),
    FP8 E4M3 with per-tensor scales: torch.float8_e4m3fn, or torch.uint8 (TE's
    spelling of the same storage; an FP8 exp_avg_sq is kept blockwise, as
    "blockwise8": [Note: FP8 second moments] in _storage.py), or "blockwise8" (shardadam.BLOCKWISE8):
    8-bit codes of a dynamic map with a float32 maximum per block of 256
    elements (1.016 bytes per element), exp_avg signed, exp_avg_sq unsigned;
    ``state[p]`` then holds the uint8 codes and ``exp_avg_absmax`` /
    ``exp_avg_sq_absmax``, checkpoints the true fp32 values.
    bf16_stochastic_round (torchao's name): bf16 params without a master are
    rounded stochastically, so updates below half a bf16 step count in
    expectation; stochastic_round_seed (an int; default: drawn from torch's
    generator) makes the rounding repeat bit for bit (_rounding.py). It
    replaces master_weights and store_param_remainders (refused with them).

    use_decoupled_grad (TE): gradients are read from ``p.decoupled_grad`` (any
    float dtype, e.g. fp32 for bf16 params) instead of ``p.grad``; zero_grad
    resets them. set_grad_none (TE, apex): the default of zero_grad's
    set_to_none (None: torch's default, True); zero_grad(set_to_none=...)
    contradicting it raises.

    GradScaler: with capturable=True the step takes the scaler's grad_scale
    and found_inf (no host sync) and the kernel writes the gradients back
    unscaled; otherwise GradScaler unscales them itself. Either way ``.grad``
    holds unscaled gradients after ``scaler.step(opt)`` (scaled ones after a
    skipped step, as torch's fused AdamW leaves them).

    flat_grads=True: gradients live in the optimizer's flat buffers (``p.grad``
    are views into them from the first step); backward accumulates in place,
    zero_grad() zeroes the buffers (set_to_none is ignored) and step() never
    re-points its table. Every parameter then takes a step, with a zero
    gradient if backward gave it none; do not reset or replace gradients by
    other means (model.zero_grad(), p.grad = t: detected at that step, raises).

    skip_nonfinite_grads=True: a step whose gradients hold inf/NaN is skipped
    (nothing written, step counters unchanged) and counted in skipped_steps.

    state_device="cpu": the optimizer state of GPU parameters (masters,
    states, in every storage kind) lives in host memory and the CPU engine
    steps it, pipelined with the transfers: gradients go down, new
    parameters come up, nothing else crosses PCIe ([Note: host state] in
    _host_state.py). The host copy of a parameter that is its own master is
    authoritative between steps; writes to the parameter through torch
    (p.copy_ under no_grad, load_state_dict, nn.init) are read back at the
    next step. Not with capturable or flat_grads. DTensor parameters (FSDP2)
    keep host copies of their local shards. For CPU parameters it changes
    nothing.

    TE's state accessors: get_unscaled_state, set_scaled_state and
    initialize_state read and write true fp32 values whatever the storage.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None, maximize=False,
                 flat_grads=False, skip_nonfinite_grads=False, bf16_stochastic_round=False,
                 stochastic_round_seed=None, state_device=None):
        _te_apex.check_options(betas, exp_avg_dtype, exp_avg_sq_dtype, set_grad_none=set_grad_none,
                               use_decoupled_grad=use_decoupled_grad, flat_grads=flat_grads)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, maximize=maximize)
        super().__init__(params, defaults, AdamRule(adam_w_mode, amsgrad), capturable=capturable,
                         master_weights=bool(master_weights), master_weight_dtype=master_weight_dtype,
                         state_dtypes=dict(exp_avg=exp_avg_dtype, exp_avg_sq=exp_avg_sq_dtype),
                         store_param_remainders=store_param_remainders, flat_grads=flat_grads,
                         skip_nonfinite_grads=skip_nonfinite_grads,
                         grad_of=decoupled_grad if use_decoupled_grad else GRAD,
                         bf16_stochastic_round=bf16_stochastic_round, stochastic_round_seed=stochastic_round_seed,
                         state_device=state_device)
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.set_grad_none = set_grad_none
        self._state_access = _te_apex.StateAccess(self)
        masters = _te_apex.master_list(master_weights, self.param_groups)
        if masters:
            _te_apex.check_master_list(masters, store_param_remainders)
            for p, m in masters:
                if p.requires_grad:
                    self._state_access.set(p, _te_apex.MASTER, m.to(p.device))

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a generator is read once: keep what was read
            param_group["params"] = params = list(params)  # (torch.optim's add_param_group does the same)
        _te_apex.check_plain_params(f"param_groups[{len(self.param_groups)}]",
                                    [params] if isinstance(params, torch.Tensor) else params)
        super().add_param_group(param_group)

    def step(self, closure=None):
        if self.use_decoupled_grad and getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("FusedAdam(use_decoupled_grad=True) under torch.amp.GradScaler: the scaler checks "
                               "and unscales p.grad, not p.decoupled_grad, so it would miss inf/NaN gradients; "
                               "scale and check decoupled gradients yourself (or skip_nonfinite_grads=True)")
        return super().step(closure)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Resets gradients: to None when set_to_none (default: set_grad_none
        if given at construction, else True), else to zeros; with
        use_decoupled_grad, ``p.decoupled_grad`` instead of ``p.grad``."""
        set_to_none = _te_apex.resolve_set_to_none(self.set_grad_none, set_to_none)
        if self.use_decoupled_grad:
            _te_apex.zero_decoupled_grads(self.param_groups, set_to_none)
        else:
            super().zero_grad(set_to_none=set_to_none)

    def get_unscaled_state(self, param, state_name: str) -> torch.Tensor:
        """TE's accessor: a new fp32 tensor of the true values of ``state_name``
        (exp_avg, exp_avg_sq, max_exp_avg_sq with AMSGrad, or master_param:
        the exact master, remainders joined; the parameter's own value where
        it is its own master)."""
        return self._state_access.get(param, state_name)

    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """TE's accessor: store float32 true values into ``state_name`` (fp16
        storage gets its per-tensor scale; a remainder master also takes TE's
        int16 remainders)."""
        self._state_access.set(param, state_name, unscaled_state)

    def initialize_state(self, param, store_param_remainders: bool | None = None) -> None:
        """TE's accessor: zero the parameter's moments and start its master
        from the parameter. store_param_remainders, when given, must match how
        the constructor's options store this parameter."""
        self._state_access.initialize(param, store_param_remainders)
