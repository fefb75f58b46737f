"""The Muon groups' step on one device: the Newton-Schulz batches and the
two plans of the element-wise passes around them ([Note: batched
Newton-Schulz] in _newton_schulz.py).

A layout is built for one set of stepping parameters (those with a gradient)
and reused while that set, their addresses, the gradients' dtypes, the
momentum buffers and the groups' Newton-Schulz settings stay the same
(``key``); the plans then only re-point their gradient list each step
([Note: borrowed read lists] in _plan.py).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from . import kernels
from ._newton_schulz import lr_ratio, newton_schulz_

GRADS = 1  # the gradient list's index in an update plan (UpdateList in cpp/update_rule.h)


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The matrices a Muon parameter holds: itself (2-D), or each p[i] (3-D)."""
    return (p.size(-2), p.size(-1))


def ns_settings(group: dict) -> tuple:
    return (tuple(float(c) for c in group["ns_coefficients"]), int(group["ns_steps"]), float(group["eps"]))


@dataclass
class Entry:
    """One stepping Muon parameter."""
    group: int
    param: torch.Tensor
    grad: torch.Tensor
    momentum_buffer: torch.Tensor


def layout_key(entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype) -> tuple:
    """What a layout depends on; O(parameters), no device work."""
    return (ns_dtype,
            tuple((e.group, id(e.param), e.param.data_ptr(), e.grad.dtype, e.momentum_buffer.data_ptr())
                  for e in entries),
            tuple(ns_settings(g) for g in param_groups if g.get("use_muon", True)))


class MuonLayout:
    """Kernel groups are (param group, matrix shape) segments, in that order:
    the momentum pass reads each group's momentum and nesterov, the update
    pass its lr and weight decay with the shape's lr ratio. Newton-Schulz
    batches are (matrix shape, settings): one stacked buffer each, into which
    the momentum pass writes and from which the update pass reads."""

    def __init__(self, entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype, key: tuple):
        self.key = key
        entries = sorted(entries, key=lambda e: (e.group, matrix_shape(e.param)))  # stable: group order kept
        self.entries = entries
        device = entries[0].param.device
        # Newton-Schulz batches: their matrices, in plan order.
        counts: dict[tuple, int] = defaultdict(int)
        for e in entries:
            counts[(matrix_shape(e.param), ns_settings(param_groups[e.group]))] += _matrices(e.param)
        self.batches = {k: torch.empty((n,) + k[0], dtype=ns_dtype, device=device) for k, n in counts.items()}
        used: dict[tuple, int] = defaultdict(int)
        views = []
        for e in entries:
            k = (matrix_shape(e.param), ns_settings(param_groups[e.group]))
            n = _matrices(e.param)
            views.append(self.batches[k][used[k]:used[k] + n].view(e.param.shape))
            used[k] += n
        # Kernel groups: runs of one (param group, shape).
        self.segments: list[tuple[int, tuple[int, int]]] = []
        sizes: list[int] = []
        for e in entries:
            seg = (e.group, matrix_shape(e.param))
            if not self.segments or self.segments[-1] != seg:
                self.segments.append(seg)
                sizes.append(0)
            sizes[-1] += 1
        grads = [e.grad for e in entries]
        self.momentum_plan = kernels.MuonMomentumPlan(views, grads, [e.momentum_buffer for e in entries],
                                                      group_sizes=sizes)
        self.momentum_plan.release_read_list(GRADS)  # handed again at each step
        self.update_plan = kernels.MuonUpdatePlan([e.param for e in entries], views, group_sizes=sizes)

    def step(self, grads_by_param: dict, param_groups: list[dict], *, grad_scale, found_inf,
             unscale_grads: bool) -> None:
        """Momentum pass, Newton-Schulz per batch, update pass; nothing is
        read back to the host. grads_by_param: id(param) -> this step's
        gradient (checked by the caller)."""
        groups = [param_groups[g] for g, _ in self.segments]
        plan = self.momentum_plan
        plan.refresh_read_list(GRADS, [grads_by_param[id(e.param)] for e in self.entries])
        try:
            kernels.muon_momentum(plan, momentum=[g["momentum"] for g in groups],
                                  nesterov=[g["nesterov"] for g in groups], grad_scale=grad_scale,
                                  found_inf=found_inf, unscale_grads=unscale_grads)
        finally:
            plan.release_read_list(GRADS)  # [Note: borrowed read lists] in _plan.py
        for (_, settings), x in self.batches.items():
            newton_schulz_(x, *settings)
        kernels.muon_update(self.update_plan, lr=[g["lr"] for g in groups],
                            weight_decay=[g["weight_decay"] for g in groups],
                            lr_ratio=[lr_ratio(param_groups[gi]["adjust_lr_fn"], *shape)
                                      for gi, shape in self.segments],
                            found_inf=found_inf)


def _matrices(p: torch.Tensor) -> int:
    return p.size(0) if p.ndim == 3 else 1
