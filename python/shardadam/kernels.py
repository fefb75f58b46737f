"""Low-level multi-tensor kernels on torch tensors, CPU and CUDA.

Each kernel takes lists of tensors (or single flat tensors) and runs as one
launch over all of them on the caller's current CUDA stream, or on the CPU
threads torch is allowed (``torch.get_num_threads()``), with the GIL released.

Building the table of tensors costs host time per tensor; build a plan once
(``AdamPlan``, ``ScalePlan``, ``NormPlan``) and pass it instead of the lists to
make every later call cost the same whatever the number of tensors. Plans
built before CUDA graph capture can be launched inside it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _core
from ._plan import TensorPlan
from ._torch import as_list, flag_ptr, per_tensor_ptr, scalar

__all__ = ["AdamPlan", "ScalePlan", "NormPlan", "Norms", "adam", "scale", "copy", "l2_norm"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class AdamPlan(TensorPlan):
    """The tensors of an Adam update.

    params: fp32/fp16/bf16, updated in place (the master weights when params_out
    is given). grads: any of those dtypes. exp_avgs, exp_avg_sqs: fp32/fp16/bf16.
    max_exp_avg_sqs: AMSGrad. params_out: the new params again, in another dtype
    (e.g. the bf16 model copy of fp32 masters). param_remainders: int16 low halves
    that make bf16 params exact fp32 masters. exp_avg_scales, exp_avg_sq_scales,
    master_scales: float32 [len(params)] per-tensor scales of low-precision states
    (stored = true * scale, powers of two; start them at 1); the kernel picks new
    scales every step. group_sizes: split the tensors, in order, into groups with
    their own hyperparameters. device: where a plan of no tensors runs (a rank
    whose shard is empty); otherwise taken from the tensors.
    """

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, *, max_exp_avg_sqs=None, params_out=None,
                 param_remainders=None, exp_avg_scales=None, exp_avg_sq_scales=None, master_scales=None,
                 group_sizes: Sequence[int] | None = None, device=None):
        lists = {
            "params": (as_list("params", params), True, FLOATS),
            "grads": (as_list("grads", grads), False, FLOATS),
            "exp_avgs": (as_list("exp_avgs", exp_avgs), True, FLOATS),
            "exp_avg_sqs": (as_list("exp_avg_sqs", exp_avg_sqs), True, FLOATS),
            "max_exp_avg_sqs": (as_list("max_exp_avg_sqs", max_exp_avg_sqs), True, FLOATS),
            "params_out": (as_list("params_out", params_out), True, FLOATS),
            "param_remainders": (as_list("param_remainders", param_remainders), True, (torch.int16,)),
        }
        for name in ("grads", "exp_avgs", "exp_avg_sqs"):
            if lists[name][0] is None:
                raise ValueError(f"adam: {name} must be given")
        n = len(lists["params"][0] or [])
        super().__init__("adam", lists, groups=_group_index(group_sizes, n),
                         num_groups=len(group_sizes) if group_sizes is not None else 1, device=device)
        self._scale_tensors = (master_scales, exp_avg_scales, exp_avg_sq_scales)
        self.scale_ptrs = (
            per_tensor_ptr("master_scales", master_scales, n, self.device),
            per_tensor_ptr("exp_avg_scales", exp_avg_scales, n, self.device),
            per_tensor_ptr("exp_avg_sq_scales", exp_avg_sq_scales, n, self.device),
        )
        _core.check_adam_table(self.table, master_scales is not None)


class ScalePlan(TensorPlan):
    """outputs[i] = inputs[i] * scale, across float dtypes; in place when outputs is inputs."""

    def __init__(self, inputs, outputs):
        super().__init__("scale", {
            "inputs": (as_list("inputs", inputs), False, FLOATS),
            "outputs": (as_list("outputs", outputs), True, FLOATS),
        }, alias_list=0)
        if self.lists["outputs"] is None:
            raise ValueError("scale: outputs must be given (pass inputs again to scale in place)")


class NormPlan(TensorPlan):
    """Tensors whose L2 norms are taken together."""

    def __init__(self, tensors):
        super().__init__("l2_norm", {"tensors": (as_list("tensors", tensors), False, FLOATS)})


class Norms(NamedTuple):
    total: torch.Tensor             # 0-d float32: L2 norm over all elements of all tensors
    per_tensor: torch.Tensor | None  # float32 [len(tensors)] when asked for
    nonfinite: torch.Tensor         # float32 [1]: 1.0 when any element is inf or NaN


def _group_index(group_sizes, n: int) -> list[int]:
    if group_sizes is None:
        return []
    sizes = list(group_sizes)
    if not sizes or any((not isinstance(s, int)) or s < 0 for s in sizes) or sum(sizes) != n:
        raise ValueError(f"group_sizes must be non-negative ints adding up to the number of tensors ({n}), "
                         f"got {sizes}")
    return [g for g, size in enumerate(sizes) for _ in range(size)]


def _per_group(name: str, value, g: int, count: int):
    """A hyperparameter given once for all groups, or as one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} values for {count} groups")
        return value[g]
    return value


def _plan(cls, first, rest_given: bool, *args, **kwargs):
    if isinstance(first, cls):
        if rest_given:
            raise TypeError(f"pass either a {cls.__name__} or the tensor lists, not both")
        return first
    return cls(first, *args, **kwargs)


def adam(params, grads=None, exp_avgs=None, exp_avg_sqs=None, *, lr, step, beta1=0.9, beta2=0.999,
         eps=1e-8, weight_decay=0.0, adam_w_mode=True, bias_correction=True, maximize=False,
         grad_scale=1.0, found_inf=None, **plan_lists) -> None:
    """One Adam (adam_w_mode=False) or AdamW step over all tensors, in place.

    params is an AdamPlan or the params list (then grads, exp_avgs, exp_avg_sqs
    and any AdamPlan keyword are lists too). lr, step and grad_scale are numbers
    or one-element tensors read by the kernel (CUDA-graph capturable). step is
    the number of this update, starting at 1. grad_scale multiplies every
    gradient. When found_inf (float32 [1]) is nonzero nothing is written.
    Hyperparameters may be sequences with one value per group of the plan.
    """
    plan = _plan(AdamPlan, params, grads is not None or bool(plan_lists),
                 grads, exp_avgs, exp_avg_sqs, **plan_lists)
    count = plan.table.num_groups
    groups = []
    for g in range(count):
        group = _core.AdamGroup()
        b1, b2 = _per_group("beta1", beta1, g, count), _per_group("beta2", beta2, g, count)
        e, wd = _per_group("eps", eps, g, count), _per_group("weight_decay", weight_decay, g, count)
        lr_g, step_g = _per_group("lr", lr, g, count), _per_group("step", step, g, count)
        bc = bool(_per_group("bias_correction", bias_correction, g, count))
        _check_hyper(b1, b2, e, wd, lr_g, step_g, bc)
        group.beta1, group.beta2, group.eps, group.weight_decay = b1, b2, e, wd
        group.adam_w_mode = bool(_per_group("adam_w_mode", adam_w_mode, g, count))
        group.bias_correction = bc
        group.maximize = bool(_per_group("maximize", maximize, g, count))
        group.lr = scalar("lr", lr_g, plan.device)
        group.step = scalar("step", step_g, plan.device)
        groups.append(group)
    extras = _core.AdamExtras()
    extras.grad_scale = scalar("grad_scale", grad_scale, plan.device)
    extras.found_inf = flag_ptr("found_inf", found_inf, plan.device)
    scratch = None
    if any(plan.scale_ptrs):
        extras.scales = plan.scale_ptrs
        scratch = torch.empty(3 * plan.num_tensors, dtype=torch.float32, device=plan.device)
        extras.amax_scratch = scratch.data_ptr()
    _core.adam(plan.table, groups, extras, *plan.target())


def _check_hyper(beta1, beta2, eps, weight_decay, lr, step, bias_correction) -> None:
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if not isinstance(lr, torch.Tensor) and not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if bias_correction and not isinstance(step, torch.Tensor) and not step >= 1:
        raise ValueError(f"step must be >= 1 (the number of this update) with bias correction, got {step}")


def scale(inputs, outputs=None, scale=1.0, *, found_inf=None, skip_if=None) -> None:
    """outputs = inputs * scale, converting dtypes (round to nearest even).

    inputs is a ScalePlan or a list; outputs may be inputs itself (in place).
    found_inf (float32 [1]) is set to 1 if any input is inf or NaN. When skip_if
    (float32 [1]) is nonzero nothing is written.
    """
    plan = _plan(ScalePlan, inputs, False, outputs) if not isinstance(inputs, ScalePlan) \
        else _plan(ScalePlan, inputs, outputs is not None)
    _core.scale(plan.table, scalar("scale", scale, plan.device), flag_ptr("found_inf", found_inf, plan.device),
                flag_ptr("skip_if", skip_if, plan.device), *plan.target())


def copy(inputs, outputs=None, *, skip_if=None) -> None:
    """outputs = inputs with dtype conversion; nothing is written when skip_if is set."""
    scale(inputs, outputs, 1.0, skip_if=skip_if)


def l2_norm(tensors, *, per_tensor: bool = False, found_inf=None) -> Norms:
    """L2 norm of all elements together (and of each tensor), accumulated in fp32.

    Deterministic: the same inputs give the same bits on every call. Non-finite
    elements set Norms.nonfinite, which is found_inf itself when given (it is
    set, never cleared).
    """
    plan = tensors if isinstance(tensors, NormPlan) else NormPlan(tensors)
    dev = plan.device
    partials = torch.empty(max(plan.table.num_chunks, 1), dtype=torch.float32, device=dev)
    total = torch.empty((), dtype=torch.float32, device=dev)
    per = torch.empty(plan.num_tensors, dtype=torch.float32, device=dev) if per_tensor else None
    flag = torch.zeros(1, dtype=torch.float32, device=dev) if found_inf is None else found_inf
    _core.l2_norm(plan.table, partials.data_ptr(), per.data_ptr() if per is not None else 0, total.data_ptr(),
                  flag_ptr("found_inf", flag, dev), *plan.target())
    return Norms(total, per, flag)
