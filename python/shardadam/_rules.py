"""Update rules: the part of an optimizer that is its math.

[Note: update rules] The optimizers own everything around the math: storage
(FusedAdam's buckets, the ZeRO engine's shards), gradient and parameter sync,
AMP, clipping, skipped steps and both checkpoint formats. An update rule owns
only what differs between Adam and another element-wise optimizer:

- ``states``: the per-parameter state it keeps, in the kernel's list order
  (names as torch.optim spells them: they are the checkpoints' keys);
- ``scalable``: which of them may be stored in fp16 with per-tensor scales;
- ``check_group``: its hyperparameters' checks (one group, or the defaults);
- ``plan`` and ``launch``: how its kernel's plan is built from the storage's
  lists and launched with the groups' hyperparameters.

A new optimizer is one element functor in the core (cpp/), one rule here, and
constructors that hand the rule to the shared optimizers.

[Note: torch.optim's checkpoint schema] torch.distributed.checkpoint loads
into the keys of the loading optimizer's own state dict and refuses a
checkpoint that lacks one ("Missing key in checkpoint state_dict"); with
allow_partial_load it silently keeps the loading optimizer's value. So a run
moves between torch.optim.AdamW and FusedAdam through DCP, in either
direction, only if both save the same keys: FusedAdam saves torch's schema
(AdamRule.to_torch_schema: the step per parameter, torch's group keys), and
a group key torch does not save (bias_correction) is saved only where its
value is not what its absence means (absent_group_values), which a load
then restores. The loaders take every format (_state_dict_check.py).
"""
from __future__ import annotations

import torch

from . import kernels
from ._validate import check_adam_group, check_lion_group


class UpdateRule:
    """The interface the optimizers use; see [Note: update rules]."""

    name: str = ""
    title: str = ""  # how messages name it
    states: tuple[str, ...] = ()
    # States a checkpoint of this rule may hold (all of its options' states);
    # the ones the optimizer does not keep are ignored at load.
    known_states: tuple[str, ...] = ()
    scalable: tuple[str, ...] = ()
    # Group hyperparameters every group has, as the rule's constructor names them.
    group_keys: tuple[str, ...] = ()

    def check_group(self, where: str, group: dict) -> None:
        raise NotImplementedError

    def plan(self, params: list, grads: list, states: dict, *, params_out=None, param_remainders=None,
             scales: dict | None = None, absmax: dict | None = None, group_sizes=None,
             device=None) -> kernels.TensorPlan:
        """The kernel's plan over `params` (the values updated: masters where
        there are masters), with ``states[name]`` a list per state,
        ``scales[name]`` the per-tensor scales of fp16 storage ("master"
        included), or None, and ``absmax[name]`` a list of the block maxima
        of each blockwise state's tensors. The optimizers check their own tensors every step
        and own the rest, so the plan does not re-check addresses."""
        raise NotImplementedError

    def hyper(self, param_groups: list[dict]) -> dict:
        """The kernel's keyword arguments, one value per group."""
        raise NotImplementedError

    def launch(self, plan, hyper: dict, *, grad_scale, found_inf, unscale_grads=False, rounding_seed=None) -> None:
        """One step; unscale_grads stores the unscaled gradients back, and
        rounding_seed rounds bf16 masters stochastically (see kernels.adam)."""
        raise NotImplementedError

    def options(self) -> dict:
        """What the rule was built with, for reprs."""
        return {}

    # Group keys a checkpoint may leave out, and what their absence means.
    absent_group_values: dict = {}

    def to_torch_schema(self, groups: list[dict], state: dict) -> None:
        """Reshape a fused optimizer's packed state dict, in place, into the
        schema of the torch optimizer it replaces ([Note: torch.optim's
        checkpoint schema]); by default it stays as packed."""


class AdamRule(UpdateRule):
    """Adam (adam_w_mode=False: L2 weight decay) and AdamW, with AMSGrad."""

    name = "adam"
    title = "Adam"
    known_states = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    scalable = ("exp_avg", "exp_avg_sq")
    group_keys = ("lr", "betas", "eps", "weight_decay", "bias_correction")

    def __init__(self, adam_w_mode: bool = True, amsgrad: bool = False):
        self.adam_w_mode = bool(adam_w_mode)
        self.amsgrad = bool(amsgrad)
        self.states = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def check_group(self, where: str, group: dict) -> None:
        check_adam_group(where, group)

    def plan(self, params, grads, states, *, params_out=None, param_remainders=None, scales=None, absmax=None,
             group_sizes=None, device=None):
        scales, absmax = scales or {}, absmax or {}
        return kernels.AdamPlan(params, grads, states["exp_avg"], states["exp_avg_sq"],
                                max_exp_avg_sqs=states.get("max_exp_avg_sq"), params_out=params_out,
                                param_remainders=param_remainders, exp_avg_scales=scales.get("exp_avg"),
                                exp_avg_sq_scales=scales.get("exp_avg_sq"), master_scales=scales.get("master"),
                                exp_avg_absmax=absmax.get("exp_avg"), exp_avg_sq_absmax=absmax.get("exp_avg_sq"),
                                group_sizes=group_sizes, device=device, check_addresses=False)

    def hyper(self, param_groups):
        groups = param_groups
        return dict(lr=[g["lr"] for g in groups], step=[g["step"] for g in groups],
                    beta1=[g["betas"][0] for g in groups], beta2=[g["betas"][1] for g in groups],
                    eps=[g["eps"] for g in groups], weight_decay=[g["weight_decay"] for g in groups],
                    bias_correction=[g["bias_correction"] for g in groups],
                    maximize=[g.get("maximize", False) for g in groups], adam_w_mode=self.adam_w_mode)

    def launch(self, plan, hyper, *, grad_scale, found_inf, unscale_grads=False, rounding_seed=None):
        kernels.adam(plan, grad_scale=grad_scale, found_inf=found_inf, unscale_grads=unscale_grads,
                     stochastic_rounding_seed=rounding_seed, **hyper)

    def options(self):
        return dict(adam_w_mode=self.adam_w_mode, amsgrad=self.amsgrad)

    # torch.optim.Adam/AdamW always correct the bias and save no such key.
    absent_group_values = {"bias_correction": True}

    def to_torch_schema(self, groups, state):
        """torch.optim.AdamW's keys: the step per parameter (a float32
        tensor), none in the groups; torch's group options with the values
        that mean this optimizer (foreach and fused left to the loading
        optimizer: None); bias_correction only where it is False."""
        for g in groups:
            step = g.pop("step")
            for key in g["params"]:
                if key in state:
                    state[key]["step"] = torch.tensor(float(step), dtype=torch.float32)
            if g.get("bias_correction", True):
                g.pop("bias_correction", None)
            g.update(amsgrad=self.amsgrad, foreach=None, capturable=False, differentiable=False, fused=None,
                     decoupled_weight_decay=self.adam_w_mode)
            g["params"] = g.pop("params")  # last, as torch lists it


class LionRule(UpdateRule):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms"), as lion-pytorch computes it: p *= 1 - lr * weight_decay;
    p -= lr * sign(beta1 * m + (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g."""

    name = "lion"
    title = "Lion"
    states = known_states = scalable = ("exp_avg",)
    group_keys = ("lr", "betas", "weight_decay")

    def check_group(self, where: str, group: dict) -> None:
        check_lion_group(where, group)

    def plan(self, params, grads, states, *, params_out=None, param_remainders=None, scales=None, absmax=None,
             group_sizes=None, device=None):
        scales, absmax = scales or {}, absmax or {}
        return kernels.LionPlan(params, grads, states["exp_avg"], params_out=params_out,
                                param_remainders=param_remainders, exp_avg_scales=scales.get("exp_avg"),
                                master_scales=scales.get("master"), exp_avg_absmax=absmax.get("exp_avg"),
                                group_sizes=group_sizes, device=device, check_addresses=False)

    def hyper(self, param_groups):
        groups = param_groups
        return dict(lr=[g["lr"] for g in groups], beta1=[g["betas"][0] for g in groups],
                    beta2=[g["betas"][1] for g in groups], weight_decay=[g["weight_decay"] for g in groups],
                    maximize=[g.get("maximize", False) for g in groups], step=[g["step"] for g in groups])

    def launch(self, plan, hyper, *, grad_scale, found_inf, unscale_grads=False, rounding_seed=None):
        kernels.lion(plan, grad_scale=grad_scale, found_inf=found_inf, unscale_grads=unscale_grads,
                     stochastic_rounding_seed=rounding_seed, **hyper)
