"""Low-level multi-tensor kernels on torch tensors, CPU and CUDA.

Each kernel takes lists of tensors (or single flat tensors) and runs as one
launch over all of them on the caller's current CUDA stream, or on the CPU
threads torch is allowed (``torch.get_num_threads()``), with the GIL released.

Building the table of tensors costs host time per tensor; build a plan once
(``AdamPlan``, ``LionPlan``, ``ScalePlan``, ``NormPlan``) and pass it instead
of the lists to make every later call cost the same whatever the number of
tensors. Plans built before CUDA graph capture can be launched inside it.

Optimizer steps: ``adam`` (Adam and AdamW, with AMSGrad) and ``lion`` (Lion,
Chen et al. 2023, as lion-pytorch's ``Lion``) share one kernel: the same
lists (bf16 params with int16 remainders, a params_out copy, per-tensor
scaled fp16/bf16 states), per-group hyperparameters and found_inf skip.

Muon's element-wise passes (``MuonMomentumPlan`` / ``muon_momentum``: the
momentum buffers and the Newton-Schulz input; ``MuonUpdatePlan`` /
``muon_update``: decoupled decay and the orthogonalized step) are two rules
of the same kernel; FusedMuon runs Newton-Schulz between them.

Checkpoint conversions: ``split_remainders`` and ``join_remainders`` turn fp32
masters into bf16 params + int16 remainders and back, bit for bit as the
update stores them; ``pow2_scale_for`` is the scale the kernels choose for
scaled fp16 states; ``blockwise_quantize`` and ``blockwise_dequantize``
convert to and from blockwise 8-bit states (``q8_map``: their dynamic maps).

Safety at launch: a plan checks (check_addresses=True, the default) that its
tensors were not re-pointed since it was built (``t.data = ...``, ``set_()``,
``resize_()``, a freed storage) and raises RuntimeError if one was, before
launching. Every launch bumps the autograd version counters of the tensors it
writes, like torch's in-place ops. Hyperparameters given as Python numbers are
checked (finite, in range); one-element tensor hyperparameters (lr, step,
grad_scale, scale) are read by the kernel on the device and never read back,
so their values are not checked.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import _core
from ._addresses import bump_versions
from ._plan import TensorPlan
from ._torch import as_list, bump_flag, flag_ptr, per_tensor_ptr, scalar, version_roots
from ._validate import (check_beta, check_finite, check_host_number, check_nonnegative, check_positive,
                        check_update_step)

__all__ = ["AdamPlan", "LionPlan", "MuonMomentumPlan", "MuonUpdatePlan", "ScalePlan", "NormPlan", "Norms", "adam", "lion", "muon_momentum", "muon_update", "scale", "copy",
           "l2_norm", "split_remainders", "join_remainders", "pow2_scale_for", "blockwise_quantize",
           "blockwise_dequantize", "q8_map"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# States may also be FP8 E4M3 (with per-tensor scales, exp_avg and exp_avg_sq only).
STATE_FLOATS = FLOATS + (torch.float8_e4m3fn,)


# Blockwise 8-bit states ([Note: blockwise 8-bit states] in cpp/dtype.h) are
# uint8 tensors of codes, exp_avg in the signed dynamic map and exp_avg_sq in
# the unsigned one, each with a float32 list of its blocks' maxima.
_SIGNED_CODES = {torch.uint8: _core.DType.q8_signed}
_UNSIGNED_CODES = {torch.uint8: _core.DType.q8_unsigned}

# The lists of the core's update op, in its order (UpdateList in cpp/update_rule.h):
# name -> (written, allowed dtypes[, options]). A rule's plan gives the lists it uses.
_UPDATE_LISTS = {
    "params": (True, FLOATS),
    "grads": (False, FLOATS),
    "exp_avgs": (True, STATE_FLOATS + (torch.uint8,), {"codes": _SIGNED_CODES}),
    "exp_avg_sqs": (True, STATE_FLOATS + (torch.uint8,), {"codes": _UNSIGNED_CODES}),
    "max_exp_avg_sqs": (True, FLOATS),
    "params_out": (True, FLOATS),
    "param_remainders": (True, (torch.int16,)),
    "exp_avg_absmax": (True, (torch.float32,), {"blocks_of": "exp_avgs"}),
    "exp_avg_sq_absmax": (True, (torch.float32,), {"blocks_of": "exp_avg_sqs"}),
}
# Per-tensor scales of scaled states, in the core's order (ScaledState in cpp/ops.h).
_UPDATE_SCALES = ("master_scales", "exp_avg_scales", "exp_avg_sq_scales")


class _UpdatePlan(TensorPlan):
    """The tensors of one optimizer step of any update rule (AdamPlan, ...).

    kind: the rule's name; check_table: the core's table check for the rule.
    required: the lists that must be given besides params. lists, scales: the
    rule's given lists and scales by name (see _UPDATE_LISTS, _UPDATE_SCALES);
    the others are absent.
    """

    def __init__(self, kind: str, check_table, required: tuple[str, ...], lists: dict, scales: dict,
                 group_sizes: Sequence[int] | None, device, check_addresses: bool):
        lists = {name: (as_list(name, lists.get(name)), *role) for name, role in _UPDATE_LISTS.items()}
        for name in required:
            if lists[name][0] is None:
                raise ValueError(f"{kind}: {name} must be given")
        n = len(lists["params"][0] or [])
        super().__init__(kind, lists, groups=_group_index(group_sizes, n),
                         num_groups=len(group_sizes) if group_sizes is not None else 1, device=device,
                         check_addresses=check_addresses)
        self.scale_ptrs = tuple(per_tensor_ptr(name, scales.get(name), n, self.device) for name in _UPDATE_SCALES)
        check_table(self.table, sum(1 << i for i, name in enumerate(_UPDATE_SCALES) if scales.get(name) is not None))
        # The kernel reads and writes the scales through their addresses too.
        for name in _UPDATE_SCALES:
            self._watch(name, scales.get(name), written=True)


class AdamPlan(_UpdatePlan):
    """The tensors of an Adam update.

    params: fp32/fp16/bf16, updated in place (the master weights when params_out
    is given). grads: any of those dtypes. exp_avgs, exp_avg_sqs: fp32/fp16/bf16,
    float8_e4m3fn (with scales), or uint8: blockwise 8-bit codes (exp_avgs in
    the signed dynamic map, exp_avg_sqs in the unsigned one) whose block maxima
    are exp_avg_absmax / exp_avg_sq_absmax: float32, one per 256 elements of
    the tensor in memory order (rounded up), written by every step; start
    codes and maxima at 0 or use ``blockwise_quantize``. max_exp_avg_sqs: AMSGrad. params_out: the new params again, in another dtype
    (e.g. the bf16 model copy of fp32 masters). param_remainders: int16 low halves
    that make bf16 params exact fp32 masters. exp_avg_scales, exp_avg_sq_scales,
    master_scales: float32 [len(params)] per-tensor scales of low-precision states
    (stored = true * scale, powers of two; start them at 1); the kernel picks new
    scales every step. group_sizes: split the tensors, in order, into groups with
    their own hyperparameters. device: where a plan of no tensors runs (a rank
    whose shard is empty); otherwise taken from the tensors. check_addresses:
    verify at every launch that no tensor (scales included) was re-pointed
    since the plan was built (see TensorPlan); False skips that check.
    Every launch bumps the version counters of params, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs, params_out, param_remainders and the scales.
    """

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, *, max_exp_avg_sqs=None, params_out=None,
                 param_remainders=None, exp_avg_scales=None, exp_avg_sq_scales=None, master_scales=None,
                 exp_avg_absmax=None, exp_avg_sq_absmax=None, group_sizes: Sequence[int] | None = None, device=None,
                 check_addresses: bool = True):
        lists = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                     max_exp_avg_sqs=max_exp_avg_sqs, params_out=params_out, param_remainders=param_remainders,
                     exp_avg_absmax=exp_avg_absmax, exp_avg_sq_absmax=exp_avg_sq_absmax)
        scales = dict(master_scales=master_scales, exp_avg_scales=exp_avg_scales,
                      exp_avg_sq_scales=exp_avg_sq_scales)
        super().__init__("adam", _core.check_adam_table, ("grads", "exp_avgs", "exp_avg_sqs"), lists, scales,
                         group_sizes, device, check_addresses)


class LionPlan(_UpdatePlan):
    """The tensors of a Lion update.

    params: fp32/fp16/bf16, updated in place (the master weights when params_out
    is given). grads: any of those dtypes. exp_avgs: Lion's only state, as
    AdamPlan's (uint8: blockwise 8-bit with exp_avg_absmax). params_out,
    param_remainders, exp_avg_scales, master_scales, group_sizes, device,
    check_addresses: as for AdamPlan. Every launch bumps
    the version counters of params, exp_avgs, params_out, param_remainders and
    the scales.
    """

    def __init__(self, params, grads, exp_avgs, *, params_out=None, param_remainders=None, exp_avg_scales=None,
                 master_scales=None, exp_avg_absmax=None, group_sizes: Sequence[int] | None = None, device=None,
                 check_addresses: bool = True):
        lists = dict(params=params, grads=grads, exp_avgs=exp_avgs, params_out=params_out,
                     param_remainders=param_remainders, exp_avg_absmax=exp_avg_absmax)
        scales = dict(master_scales=master_scales, exp_avg_scales=exp_avg_scales)
        super().__init__("lion", _core.check_lion_table, ("grads", "exp_avgs"), lists, scales, group_sizes, device,
                         check_addresses)


class MuonMomentumPlan(_UpdatePlan):
    """The tensors of Muon's momentum pass (see muon_momentum).

    updates: fp32/fp16/bf16, written: the Newton-Schulz input of each matrix
    (bf16 as torch.optim.Muon orthogonalizes). grads: any float dtype.
    momentum_buffers: fp32/fp16/bf16, updated in place. group_sizes, device,
    check_addresses: as for AdamPlan. Every launch bumps the version counters
    of updates and momentum_buffers.
    """

    def __init__(self, updates, grads, momentum_buffers, *, group_sizes: Sequence[int] | None = None, device=None,
                 check_addresses: bool = True):
        lists = dict(params=updates, grads=grads, exp_avgs=momentum_buffers)
        super().__init__("muon_momentum", _core.check_muon_momentum_table, ("grads", "exp_avgs"), lists, {},
                         group_sizes, device, check_addresses)


class MuonUpdatePlan(_UpdatePlan):
    """The tensors of Muon's update pass (see muon_update).

    params: fp32/fp16/bf16, updated in place. updates: the orthogonalized
    update of each parameter (any float dtype, read). params_out,
    param_remainders, master_scales, group_sizes, device, check_addresses: as
    for AdamPlan. Every launch bumps the version counters of params,
    params_out, param_remainders and master_scales.
    """

    def __init__(self, params, updates, *, params_out=None, param_remainders=None, master_scales=None,
                 group_sizes: Sequence[int] | None = None, device=None, check_addresses: bool = True):
        lists = dict(params=params, grads=updates, params_out=params_out, param_remainders=param_remainders)
        super().__init__("muon_update", _core.check_muon_update_table, ("grads",), lists,
                         dict(master_scales=master_scales), group_sizes, device, check_addresses)


class ScalePlan(TensorPlan):
    """outputs[i] = inputs[i] * scale, across float dtypes (FP8 E4M3 included:
    round to nearest even, NaN past 464); in place when outputs is inputs.

    Blockwise 8-bit tensors (uint8 codes) take their block maxima as
    inputs_absmax / outputs_absmax (see AdamPlan), in the signed dynamic map
    unless signed=False. check_addresses: see TensorPlan. Every launch bumps
    the outputs' version counters (and outputs_absmax's).
    """

    def __init__(self, inputs, outputs, *, inputs_absmax=None, outputs_absmax=None, signed: bool = True,
                 check_addresses: bool = True):
        codes = {"codes": _SIGNED_CODES if signed else _UNSIGNED_CODES}
        super().__init__("scale", {
            "inputs": (as_list("inputs", inputs), False, STATE_FLOATS + (torch.uint8,), codes),
            "outputs": (as_list("outputs", outputs), True, STATE_FLOATS + (torch.uint8,), codes),
            "inputs_absmax": (as_list("inputs_absmax", inputs_absmax), False, (torch.float32,),
                              {"blocks_of": "inputs"}),
            "outputs_absmax": (as_list("outputs_absmax", outputs_absmax), True, (torch.float32,),
                               {"blocks_of": "outputs"}),
        }, alias_list=0, check_addresses=check_addresses)
        if self.lists["outputs"] is None:
            raise ValueError("scale: outputs must be given (pass inputs again to scale in place)")


class NormPlan(TensorPlan):
    """Tensors whose L2 norms are taken together (read only). check_addresses: see TensorPlan."""

    def __init__(self, tensors, *, check_addresses: bool = True):
        super().__init__("l2_norm", {"tensors": (as_list("tensors", tensors), False, FLOATS)},
                         check_addresses=check_addresses)


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


def _per_group(name: str, value, count: int) -> list[tuple[str, object]]:
    """(name for messages, value) per group: a hyperparameter given once for
    all groups, or as one value per group (then named name[g])."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} values for {count} groups")
        return [(f"{name}[{g}]", v) for g, v in enumerate(value)]
    return [(name, value)] * count


def _plan(cls, first, rest_given: bool, *args, **kwargs) -> TensorPlan:
    """The caller's plan, address-checked now (before anything else runs), or
    one built from the lists (just built: nothing to check)."""
    if isinstance(first, cls):
        if rest_given:
            raise TypeError(f"pass either a {cls.__name__} or the tensor lists, not both")
        if first._check_addresses:
            first._check_launch()
        return first
    return cls(first, *args, **kwargs)


def adam(params, grads=None, exp_avgs=None, exp_avg_sqs=None, *, lr, step, beta1=0.9, beta2=0.999,
         eps=1e-8, weight_decay=0.0, adam_w_mode=True, bias_correction=True, maximize=False,
         grad_scale=1.0, found_inf=None, unscale_grads=False, stochastic_rounding_seed=None,
         **plan_lists) -> None:
    """One Adam (adam_w_mode=False) or AdamW step over all tensors, in place.

    params is an AdamPlan or the params list (then grads, exp_avgs, exp_avg_sqs
    and any AdamPlan keyword are lists too). lr, step and grad_scale are numbers
    or one-element tensors read by the kernel (CUDA-graph capturable). step is
    the number of this update, starting at 1. grad_scale multiplies every
    gradient; unscale_grads=True also stores grad * grad_scale back into the
    grads, in their dtype (GradScaler's gradients come out unscaled, as torch's
    fused Adam leaves them; the grads must then not overlap any other tensor of
    the plan, checked once per plan and gradient addresses). When found_inf
    (float32 [1]) is nonzero nothing is written, the grads included.
    Hyperparameters may be sequences with one value per group of the plan.
    stochastic_rounding_seed (an int): bf16 params that are their own master
    (no remainders) are rounded stochastically, with random bits hashed from
    the seed, the step, the tensor's index in the plan and the element's
    ([Note: stochastic rounding] in cpp/dtype.h); None: to nearest.

    Numbers are checked before anything is launched, for every group: lr, eps,
    weight_decay finite and >= 0; beta1, beta2 in [0, 1); grad_scale finite and
    > 0; step finite (>= 1 with bias correction); beta1, beta2, eps and
    weight_decay must be numbers. lr, step and grad_scale given as tensors are
    read on the device, never read back: their values are not checked (a NaN
    lr tensor makes NaN params). A plan with check_addresses verifies its
    tensors' addresses first (RuntimeError if one was re-pointed). The launch
    bumps the version counters of the written tensors.
    """
    plan = _plan(AdamPlan, params, grads is not None or bool(plan_lists),
                 grads, exp_avgs, exp_avg_sqs, **plan_lists)
    _update(plan, _core.adam, grad_scale, found_inf, unscale_grads, stochastic_rounding_seed, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, lr=lr, step=step, bias_correction=bias_correction,
            adam_w_mode=adam_w_mode, maximize=maximize)


def lion(params, grads=None, exp_avgs=None, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False,
         grad_scale=1.0, found_inf=None, unscale_grads=False, step=0, stochastic_rounding_seed=None,
         **plan_lists) -> None:
    """One Lion step over all tensors, in place, as lion-pytorch's update:

        g = grad * grad_scale (negated with maximize)
        param *= 1 - lr * weight_decay
        param -= lr * sign(beta1 * exp_avg + (1 - beta1) * g)
        exp_avg = beta2 * exp_avg + (1 - beta2) * g

    in float32, with 1 - lr * weight_decay, 1 - beta1 and 1 - beta2 computed in
    double and rounded once. sign gives 0 for 0 and, unlike torch.sign, NaN for
    NaN: a non-finite gradient makes the param NaN instead of freezing it.

    params is a LionPlan or the params list (then grads, exp_avgs and any
    LionPlan keyword are lists too). lr and grad_scale are numbers or
    one-element tensors read by the kernel (CUDA-graph capturable).
    unscale_grads, stochastic_rounding_seed: as for adam (step, a number or
    a one-element tensor, keys the rounding; Lion's update does not read it).
    When found_inf (float32 [1]) is nonzero nothing is written.
    Hyperparameters may be sequences with one value per group of the plan.

    Numbers are checked before anything is launched, for every group: lr and
    weight_decay finite and >= 0; beta1, beta2 in [0, 1); grad_scale finite
    and > 0; beta1, beta2 and weight_decay must be numbers. lr and grad_scale
    given as tensors are read on the device, never read back: their values
    are not checked. A plan with check_addresses verifies its tensors'
    addresses first (RuntimeError if one was re-pointed). The launch bumps
    the version counters of the written tensors.
    """
    plan = _plan(LionPlan, params, grads is not None or bool(plan_lists), grads, exp_avgs, **plan_lists)
    _update(plan, _core.lion, grad_scale, found_inf, unscale_grads, stochastic_rounding_seed, beta1=beta1,
            beta2=beta2, weight_decay=weight_decay, lr=lr, step=step, maximize=maximize)


def muon_momentum(updates, grads=None, momentum_buffers=None, *, momentum=0.95, nesterov=True, grad_scale=1.0,
                  found_inf=None, unscale_grads=False, **plan_lists) -> None:
    """Muon's momentum pass over all tensors, as torch.optim.Muon computes it:

        g = grad * grad_scale
        momentum_buffer = lerp(momentum_buffer, g, 1 - momentum)
        update = lerp(g, momentum_buffer, momentum) if nesterov else momentum_buffer

    in float32 (lerp as torch's), 1 - momentum computed in double and rounded
    once; ``update`` is stored in the updates' dtype (the Newton-Schulz input).
    updates is a MuonMomentumPlan or the updates list (then grads,
    momentum_buffers and any MuonMomentumPlan keyword are lists too).
    grad_scale: a number or a one-element tensor read by the kernel;
    unscale_grads, found_inf: as for adam. momentum, nesterov may be
    sequences with one value per group of the plan.

    Numbers are checked before anything is launched: momentum a number in
    [0, 1), grad_scale finite and > 0.
    """
    plan = _plan(MuonMomentumPlan, updates, grads is not None or bool(plan_lists), grads, momentum_buffers,
                 **plan_lists)
    for name, value in _per_group("momentum", momentum, plan.table.num_groups):  # named as the caller names it
        check_beta(plan.kind, name, value)
    # The momentum travels as beta1; lr is not read by this pass.
    _update(plan, _core.muon_momentum, grad_scale, found_inf, unscale_grads, None, beta1=momentum,
            nesterov=nesterov, lr=0.0)


def muon_update(params, updates=None, *, lr, weight_decay=0.0, lr_ratio=1.0, found_inf=None,
                **plan_lists) -> None:
    """Muon's update pass over all tensors, as torch.optim.Muon applies it:

        param *= 1 - lr * weight_decay
        param -= lr * lr_ratio * update

    in float32, with both factors computed in double and rounded once, and
    the two steps rounded apart (torch's mul_ and add_). lr_ratio is the
    shape's learning-rate adjustment (FusedMuon's adjust_lr_fn). params is a
    MuonUpdatePlan or the params list (then updates and any MuonUpdatePlan
    keyword are lists too). lr: a number or a one-element tensor read by the
    kernel (CUDA-graph capturable). When found_inf (float32 [1]) is nonzero
    nothing is written. lr, weight_decay, lr_ratio may be sequences with one
    value per group of the plan.

    Numbers are checked before anything is launched: lr, weight_decay and
    lr_ratio finite and >= 0.
    """
    plan = _plan(MuonUpdatePlan, params, updates is not None or bool(plan_lists), updates, **plan_lists)
    _update(plan, _core.muon_update, 1.0, found_inf, False, None, lr=lr, weight_decay=weight_decay,
            lr_ratio=lr_ratio)


# AdamGroup fields (cpp/update_rule.h) by kind: read by the kernel from a number
# or a one-element tensor; booleans; host numbers in [0, 1); host numbers >= 0.
_SCALAR_FIELDS = ("lr", "step")
_FLAG_FIELDS = ("adam_w_mode", "bias_correction", "maximize", "nesterov")
_BETA_FIELDS = ("beta1", "beta2")
_NONNEGATIVE_FIELDS = ("eps", "weight_decay", "lr_ratio")


def _update(plan: _UpdatePlan, kernel, grad_scale, found_inf, unscale_grads: bool, rounding_seed,
            **hyper) -> None:
    """One step of an update rule: hyper holds the AdamGroup fields the rule
    reads, each a value for all groups or a sequence of one per group. Every
    number is checked before the launch; then the versions are bumped."""
    count = plan.table.num_groups
    columns = {field: _per_group(field, value, count) for field, value in hyper.items()}
    rows = [dict(zip(columns, row)) for row in zip(*columns.values())]
    # Every group's numbers first: a refusal leaves everything as it was.
    for row in rows:
        _check_group(plan.kind, row)
    if not isinstance(grad_scale, torch.Tensor):
        check_positive(plan.kind, "grad_scale", grad_scale)
    groups = []
    for row in rows:
        group = _core.AdamGroup()
        for field, (name, value) in row.items():
            if field in _SCALAR_FIELDS:
                value = scalar(name, value, plan.device)
            elif field in _FLAG_FIELDS:
                value = bool(value)
            setattr(group, field, value)
        groups.append(group)
    extras = _core.AdamExtras()
    extras.grad_scale = scalar("grad_scale", grad_scale, plan.device)
    extras.found_inf = flag_ptr("found_inf", found_inf, plan.device)
    extras.unscale_grads = bool(unscale_grads)
    if rounding_seed is not None:
        extras.stochastic_rounding = True
        extras.rounding_seed = int(rounding_seed) % 2 ** 64
    scratch = None
    if any(plan.scale_ptrs):
        extras.scales = plan.scale_ptrs
        scratch = torch.empty(3 * plan.num_tensors, dtype=torch.float32, device=plan.device)
        extras.amax_scratch = scratch.data_ptr()
    kernel(plan.table, groups, extras, *plan.target())
    plan._bump_versions()
    if unscale_grads:
        bump_versions(version_roots(plan.lists["grads"]))


def _check_group(kind: str, row: dict) -> None:
    """One group's hyperparameters: AdamGroup field -> (name, value)."""
    for field in _BETA_FIELDS + _NONNEGATIVE_FIELDS:
        if field in row:
            check_host_number(kind, *row[field])
    for field in _BETA_FIELDS:
        if field in row:
            check_beta(kind, *row[field])
    for field in _NONNEGATIVE_FIELDS:
        if field in row:
            check_nonnegative(kind, *row[field])
    if not isinstance(row["lr"][1], torch.Tensor):
        check_nonnegative(kind, *row["lr"])
    if "step" in row and not isinstance(row["step"][1], torch.Tensor):
        check_update_step(kind, *row["step"], "bias_correction" in row and bool(row["bias_correction"][1]))


def scale(inputs, outputs=None, scale=1.0, *, found_inf=None, skip_if=None) -> None:
    """outputs = inputs * scale, converting dtypes (round to nearest even).

    inputs is a ScalePlan or a list; outputs may be inputs itself (in place).
    found_inf (float32 [1]) is set to 1 if any input is inf or NaN. When skip_if
    (float32 [1]) is nonzero nothing is written.

    scale given as a number must be finite (any sign); a one-element tensor is
    read on the device and not checked. A plan with check_addresses verifies
    its tensors' addresses first. The launch bumps the version counters of
    the outputs and of found_inf.
    """
    plan = _plan(ScalePlan, inputs, False, outputs) if not isinstance(inputs, ScalePlan) \
        else _plan(ScalePlan, inputs, outputs is not None)
    if not isinstance(scale, torch.Tensor):
        check_finite("scale", "scale", scale)
    _core.scale(plan.table, scalar("scale", scale, plan.device), flag_ptr("found_inf", found_inf, plan.device),
                flag_ptr("skip_if", skip_if, plan.device), *plan.target())
    plan._bump_versions()
    bump_flag(found_inf)


def copy(inputs, outputs=None, *, skip_if=None) -> None:
    """outputs = inputs with dtype conversion; nothing is written when skip_if is set."""
    scale(inputs, outputs, 1.0, skip_if=skip_if)


def blockwise_quantize(values, codes, absmax, *, signed: bool = True) -> None:
    """codes, absmax = values in blockwise 8-bit storage ([Note: blockwise
    8-bit states] in cpp/dtype.h), as the update kernels store states.

    values: float tensors (read); codes: uint8 tensors of the same sizes;
    absmax: float32 tensors of one element per 256 elements of each tensor
    (in memory order, rounded up), written with each block's largest
    magnitude. signed=False: the unsigned map (non-negative values such as
    exp_avg_sq; negative values become 0). Tensors or lists of tensors; one
    launch; bad input raises before anything is written.
    """
    scale(ScalePlan(values, codes, outputs_absmax=absmax, signed=signed))


def blockwise_dequantize(codes, absmax, values, *, signed: bool = True) -> None:
    """values = the numbers blockwise 8-bit codes and their block maxima
    stand for (the inverse of blockwise_quantize, exactly what the update
    kernels read). Tensors or lists of tensors; one launch."""
    scale(ScalePlan(codes, values, inputs_absmax=absmax, signed=signed))


def q8_map(signed: bool = True) -> torch.Tensor:
    """The dynamic map of blockwise 8-bit states: the value / block maximum
    that each of the 256 codes stands for (float32 [256])."""
    return torch.tensor(_core.q8_map(bool(signed)), dtype=torch.float32)


def l2_norm(tensors, *, per_tensor: bool = False, found_inf=None) -> Norms:
    """L2 norm of all elements together (and of each tensor), accumulated in fp32.

    Deterministic: the same inputs give the same bits on every call. Non-finite
    elements set Norms.nonfinite, which is found_inf itself when given (it is
    set, never cleared). A NormPlan with check_addresses verifies its tensors'
    addresses first; a given found_inf has its version counter bumped.
    """
    plan = _plan(NormPlan, tensors, False)
    dev = plan.device
    partials = torch.empty(max(plan.table.num_chunks, 1), dtype=torch.float32, device=dev)
    total = torch.empty((), dtype=torch.float32, device=dev)
    per = torch.empty(plan.num_tensors, dtype=torch.float32, device=dev) if per_tensor else None
    flag = torch.zeros(1, dtype=torch.float32, device=dev) if found_inf is None else found_inf
    _core.l2_norm(plan.table, partials.data_ptr(), per.data_ptr() if per is not None else 0, total.data_ptr(),
                  flag_ptr("found_inf", flag, dev), *plan.target())
    bump_flag(found_inf)
    return Norms(total, per, flag)


def split_remainders(masters, params, remainders) -> None:
    """params, remainders = the bf16 high halves and int16 low halves of fp32 masters.

    Each argument is a tensor or a list of tensors, corresponding tensors with
    the same number of elements: masters float32 (read), params bfloat16 and
    remainders int16 (written). The high half is rounded to nearest, ties away
    from zero (the remainder's sign bit records the rounding), exactly as the
    update stores a master with param_remainders, so join_remainders gives back
    every fp32 bit pattern, NaN payloads included. Runs as one launch on the
    current CUDA stream or on the CPU threads; bad input raises before
    anything is written; bumps the version counters of params and remainders.
    """
    _remainder_pass("split_remainders", _core.split_remainders, {
        "masters": (masters, False, (torch.float32,)),
        "params": (params, True, (torch.bfloat16,)),
        "remainders": (remainders, True, (torch.int16,)),
    })


def join_remainders(params, remainders, masters) -> None:
    """masters = the exact fp32 values that bf16 params + int16 remainders represent.

    The inverse of split_remainders: params bfloat16 and remainders int16
    (read), masters float32 (written); tensors or lists of tensors as there.
    Bumps the version counters of masters.
    """
    _remainder_pass("join_remainders", _core.join_remainders, {
        "params": (params, False, (torch.bfloat16,)),
        "remainders": (remainders, False, (torch.int16,)),
        "masters": (masters, True, (torch.float32,)),
    })


def _remainder_pass(kind: str, kernel, lists: dict) -> None:
    """One conversion over lists: name -> (tensors, written, allowed dtypes).
    A plan built for this call (conversions run at checkpoint time, where the
    host cost of tabling the tensors does not matter); just built, so its
    addresses need no check."""
    for name, (tensors, _, _) in lists.items():
        if tensors is None:
            raise ValueError(f"{kind}: {name} must be given")
    plan = TensorPlan(kind, {name: (as_list(name, tensors), written, dtypes)
                             for name, (tensors, written, dtypes) in lists.items()}, check_addresses=False)
    kernel(plan.table, *plan.target())
    plan._bump_versions()


def pow2_scale_for(amax: float, old_scale: float = 1.0, dtype: torch.dtype = torch.float16) -> float:
    """The scale the kernels choose for scaled states stored in dtype: amax *
    scale just under 2^15 for fp16 and 2^8 for torch.float8_e4m3fn (whose
    largest value is 448), powers of two; old_scale kept when amax is 0 or
    not finite.

    The core's own function, computed as the kernels do in float32: amax and
    old_scale are rounded to float32 first (an amax below float32's range
    counts as 0, above it as infinite), and the exponent is clamped to
    [-126, 126].
    """
    return _core.pow2_scale_for(float(amax), float(old_scale), 8 if dtype == torch.float8_e4m3fn else 15)
