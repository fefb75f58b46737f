"""Flat optimizer state for FusedAdam.

Parameters are split by device and by how their master value is stored:

- ``plain``: the parameter is its own master (fp32 params, or 16-bit params
  without master weights);
- ``master``: a separate master copy (``master_weight_dtype``) is updated and
  the 16-bit parameter is written as the master rounded to nearest;
- ``remainder``: bf16 parameter + int16 remainder form an exact fp32 master.

Each (device, kind) is one bucket: flat state buffers (exp_avg, exp_avg_sq,
max_exp_avg_sq, master or remainders, per-tensor scales), per-parameter views
into them (what ``optimizer.state[p]`` holds), and one AdamPlan over all its
parameters in group order, so a step is one launch per bucket whatever the
number of parameters.
"""
from __future__ import annotations

import itertools
import operator

import torch

from . import kernels
from ._torch import check_tensor

# Offsets of every parameter's state are multiples of this many elements, so
# each view starts 64-byte aligned and the kernels can use vector access.
ALIGN_ELEMS = 32

PLAIN, MASTER, REMAINDER = "plain", "master", "remainder"
# (bucket attribute, state key) of the per-tensor scales of fp16 states and masters.
SCALES = (("exp_avg_scales", "exp_avg_scale"), ("exp_avg_sq_scales", "exp_avg_sq_scale"),
          ("master_scales", "master_scale"))
GRAD_LIST = 1  # index of grads in an Adam table


def storage_kind(p: torch.Tensor, master_weights: bool, store_param_remainders: bool) -> str:
    if store_param_remainders and p.dtype == torch.bfloat16:
        return REMAINDER
    if master_weights and p.dtype in (torch.float16, torch.bfloat16):
        return MASTER
    return PLAIN


def _dense_view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of flat[offset:] with like's shape and strides (channels_last included)."""
    return torch.as_strided(flat, like.shape, like.stride(), offset)


class Bucket:
    """The parameters of one device and one storage kind, with their flat state."""

    def __init__(self, kind: str, params: list, group_of: list[int], num_groups: int, opts: dict):
        self.kind = kind
        self.params = params
        self.device = params[0].device
        self.group_sizes = [0] * num_groups
        for g in group_of:
            self.group_sizes[g] += 1
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += -(-p.numel() // ALIGN_ELEMS) * ALIGN_ELEMS
        dev, n = self.device, len(params)
        scaled_states = opts["exp_avg_dtype"] == torch.float16, opts["exp_avg_sq_dtype"] == torch.float16
        self.exp_avg = torch.zeros(total, dtype=opts["exp_avg_dtype"], device=dev)
        self.exp_avg_sq = torch.zeros(total, dtype=opts["exp_avg_sq_dtype"], device=dev)
        # The AMSGrad maximum has no scale of its own: kept in fp32 when
        # exp_avg_sq is fp16 (small values would underflow), else alike.
        max_dtype = torch.float32 if opts["exp_avg_sq_dtype"] == torch.float16 else opts["exp_avg_sq_dtype"]
        self.max_exp_avg_sq = torch.zeros(total, dtype=max_dtype, device=dev) if opts["amsgrad"] else None
        # fp16 states keep per-tensor power-of-two scales (stored = true * scale).
        self.exp_avg_scales = torch.ones(n, device=dev) if scaled_states[0] else None
        self.exp_avg_sq_scales = torch.ones(n, device=dev) if scaled_states[1] else None
        self.master = self.remainders = self.master_scales = None
        if kind == MASTER:
            self.master = torch.empty(total, dtype=opts["master_weight_dtype"], device=dev)
            if opts["master_weight_dtype"] == torch.float16:
                self.master_scales = torch.ones(n, device=dev)
        elif kind == REMAINDER:
            self.remainders = torch.zeros(total, dtype=torch.int16, device=dev)  # master == param exactly
        self.views = [self._views_of(i) for i in range(n)]
        for i, p in enumerate(params):
            if self.master is not None:
                self.views[i]["master_param"].copy_(p.detach())
        self._strides = [p.stride() for p in params]
        self._all_contiguous = all(p.is_contiguous() for p in params)
        self.flat_grads = None
        self._flat_views: list | None = None  # set by use_flat_grads
        self._plan = None
        self._grads: list | None = None

    def _views_of(self, i: int) -> dict:
        """state[p] for parameter i: views into the flat buffers, scales as 0-d views."""
        p, off = self.params[i], self.offsets[i]
        views = {"exp_avg": _dense_view(self.exp_avg, off, p), "exp_avg_sq": _dense_view(self.exp_avg_sq, off, p)}
        if self.max_exp_avg_sq is not None:
            views["max_exp_avg_sq"] = _dense_view(self.max_exp_avg_sq, off, p)
        if self.master is not None:
            views["master_param"] = _dense_view(self.master, off, p)
        if self.remainders is not None:
            views["param_remainder"] = _dense_view(self.remainders, off, p)
        for name, scales in SCALES:
            if getattr(self, name) is not None:
                views[scales] = getattr(self, name)[i]
        return views

    # ------------------------------------------------------------ gradients

    def use_flat_grads(self) -> None:
        """Make every p.grad a view into one flat buffer owned by the bucket."""
        total = self.exp_avg.numel()
        self.flat_grads = torch.zeros(total, dtype=self.params[0].dtype, device=self.device) \
            if all(p.dtype == self.params[0].dtype for p in self.params) else None
        for i, p in enumerate(self.params):
            if self.flat_grads is not None:
                view = _dense_view(self.flat_grads, self.offsets[i], p)
            else:  # mixed param dtypes in one bucket: one buffer per parameter
                view = torch.zeros_like(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
        self._flat_views = [p.grad for p in self.params]
        self._check_at = 0

    def zero_flat_grads(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.zero_()
        else:
            torch._foreach_zero_(self._flat_views)

    def check_flat_grads(self, window: int) -> None:
        """Confirm that a rotating window of parameters still has the bucket's
        gradient views (model.zero_grad() would have dropped them): every
        parameter is checked once per len(params) / window steps, and a
        model-wide reset is seen at once."""
        n = len(self.params)
        start = self._check_at
        for i in range(start, min(start + window, n)):
            if self.params[i].grad is not self._flat_views[i]:
                raise RuntimeError(
                    "FusedAdam(flat_grads=True): the gradient of a parameter was replaced or set to None "
                    "(e.g. by model.zero_grad()); with flat_grads use optimizer.zero_grad() only")
        self._check_at = 0 if start + window >= n else start + window

    def _current_grads(self) -> list | None:
        """The parameters' gradients, re-pointing the plan when autograd made
        new ones; None when some parameter has no gradient this step."""
        grads = [p.grad for p in self.params]
        cached = self._grads
        if cached is not None and all(map(operator.is_, grads, cached)):
            return grads
        if any(map(operator.is_, grads, itertools.repeat(None))):
            return None
        # torch keeps a gradient's shape, dtype and device equal to its
        # parameter's; what can differ is the layout and the memory order.
        # All-contiguous buckets (the common case) take one C-level pass.
        try:
            fast_ok = self._all_contiguous and all(map(torch.Tensor.is_contiguous, grads))
        except RuntimeError:  # sparse gradients have no is_contiguous: the checks below say so
            fast_ok = False
        if not fast_ok:
            self._check_grad_layouts(grads, cached)
        if self._plan is not None:
            self._plan.refresh_read_list(GRAD_LIST, grads)
        self._grads = grads
        return grads

    def _check_grad_layouts(self, grads: list, cached: list | None) -> None:
        strided = torch.strided
        for i, (g, stride) in enumerate(zip(grads, self._strides)):
            if (cached is None or g is not cached[i]) and (g.layout is not strided or g.stride() != stride):
                p = self.params[i]
                check_tensor(f"params[{i}].grad", g, self.device, kernels.FLOATS)
                if not (g.is_contiguous() and p.is_contiguous()):
                    raise ValueError(f"the gradient of a parameter of shape {tuple(p.shape)} has strides "
                                     f"{g.stride()} but the parameter {p.stride()}: element orders differ")

    # ------------------------------------------------------------ the step

    def _lists(self, idx: list[int], grads: list) -> dict:
        views = [self.views[i] for i in idx]
        params = [self.params[i] for i in idx]
        masters = [v["master_param"] for v in views] if self.master is not None else None
        lists = dict(
            params=masters if masters is not None else params,
            grads=[grads[i] for i in idx],
            exp_avgs=[v["exp_avg"] for v in views],
            exp_avg_sqs=[v["exp_avg_sq"] for v in views],
            max_exp_avg_sqs=[v["max_exp_avg_sq"] for v in views] if self.max_exp_avg_sq is not None else None,
            params_out=params if masters is not None else None,
            param_remainders=[v["param_remainder"] for v in views] if self.remainders is not None else None,
        )
        full = len(idx) == len(self.params)
        for name, scales in (("exp_avg_scales", self.exp_avg_scales), ("exp_avg_sq_scales", self.exp_avg_sq_scales),
                             ("master_scales", self.master_scales)):
            lists[name] = None if scales is None else (scales if full else scales[idx].clone())
        return lists

    def prepare(self) -> tuple | None:
        """Everything a step needs that can fail (gradient checks, plans), done
        before the optimizer changes anything: (plan, subset indices or None),
        or None when no parameter of the bucket has a gradient."""
        grads = self._flat_views if self._flat_views is not None else self._current_grads()
        if grads is not None:
            if self._plan is None:
                self._plan = _adam_plan(self._lists(list(range(len(self.params))), grads), self.group_sizes)
            return self._plan, None
        # Some parameters have no gradient this step: update the others only
        # (like torch.optim), through a one-off plan.
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not idx:
            return None
        grads = [None] * len(self.params)
        for i in idx:
            grads[i] = self.params[i].grad
            check_tensor(f"params[{i}].grad", grads[i], self.device, kernels.FLOATS)
        lists = self._lists(idx, grads)
        sizes = [0] * len(self.group_sizes)
        bounds = [sum(self.group_sizes[:g + 1]) for g in range(len(self.group_sizes))]
        for i in idx:
            sizes[next(g for g, b in enumerate(bounds) if i < b)] += 1
        plan = _adam_plan(lists, sizes)
        plan.subset_scales = {name: lists[name] for name, _ in SCALES}
        return plan, idx

    def launch(self, prepared: tuple, hyper: dict, grad_scale, found_inf) -> None:
        plan, idx = prepared
        kernels.adam(plan, grad_scale=grad_scale, found_inf=found_inf, **hyper)
        if idx is not None:
            for name, _ in SCALES:  # the kernel chose new scales for the subset's copy
                scales = getattr(self, name)
                if scales is not None:
                    scales[idx] = plan.subset_scales[name]

def _adam_plan(lists: dict, group_sizes: list[int]) -> kernels.AdamPlan:
    rest = dict(lists)
    return kernels.AdamPlan(rest.pop("params"), rest.pop("grads"), rest.pop("exp_avgs"), rest.pop("exp_avg_sqs"),
                            group_sizes=group_sizes, **rest)
