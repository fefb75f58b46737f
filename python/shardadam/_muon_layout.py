"""The Muon groups' step on one device: the Newton-Schulz batches and the
two plans of the element-wise passes around them ([Note: batched
Newton-Schulz] in _newton_schulz.py).

A layout is built for one set of stepping parameters (those with a gradient)
and reused while that set, their addresses, the gradients' dtypes, the
momentum buffers and the groups' Newton-Schulz settings stay the same
(``key``); the plans then only re-point their gradient list each step
([Note: borrowed read lists] in _plan.py). Where the matrices are
orthogonalized is the layout's ``matrices``: here on this device
(LocalMatrices), or on an owner rank for DTensor shards ([Note: Muon on
sharded matrices] in _muon_dtensor.py).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from . import kernels
from ._newton_schulz import lr_ratio, newton_schulz_

GRADS = 1  # the gradient list's index in an update plan (UpdateList in cpp/update_rule.h)


def matrix_shape(shape) -> tuple[int, int]:
    """The matrices a Muon parameter of this shape holds: itself (2-D), or each p[i] (3-D)."""
    return (shape[-2], shape[-1])


def ns_settings(group: dict) -> tuple:
    return (tuple(float(c) for c in group["ns_coefficients"]), int(group["ns_steps"]), float(group["eps"]))


@dataclass
class Entry:
    """One stepping Muon parameter: the tensors the kernels step (a DTensor
    parameter's local pieces) and the parameter's (global) shape."""
    group: int
    param: torch.Tensor
    grad: torch.Tensor
    momentum_buffer: torch.Tensor
    shape: tuple

    def batch_key(self, param_groups: list[dict]) -> tuple:
        """The Newton-Schulz batch its matrices join: (matrix shape, settings)."""
        return (matrix_shape(self.shape), ns_settings(param_groups[self.group]))


def layout_key(entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype) -> tuple:
    """What a layout depends on; O(parameters), no device work."""
    return (ns_dtype,
            tuple((e.group, id(e.param), e.param.data_ptr(), e.grad.dtype, e.momentum_buffer.data_ptr())
                  for e in entries),
            tuple(ns_settings(g) for g in param_groups if g.get("use_muon", True)))


class Batches:
    """The Newton-Schulz batches of one device: a [n, rows, cols] buffer in
    ns_dtype per (matrix shape, settings), handed out in slices."""

    def __init__(self, counts: dict[tuple, int], ns_dtype: torch.dtype, device: torch.device):
        self.buffers = {k: torch.empty((n,) + k[0], dtype=ns_dtype, device=device) for k, n in counts.items() if n}
        self._empty = torch.empty(0, dtype=ns_dtype, device=device)
        self._used: dict[tuple, int] = defaultdict(int)

    def take(self, key: tuple, n: int) -> torch.Tensor:
        """The next n matrices of the key's buffer."""
        start = self._used[key]
        self._used[key] += n
        return self.buffers[key][start:start + n] if n else self._empty.view((0,) + key[0])

    def orthogonalize(self) -> None:
        for (_, settings), x in self.buffers.items():
            newton_schulz_(x, *settings)


class LocalMatrices:
    """Every matrix orthogonalized on this device: each entry's Newton-Schulz
    input and output are its slice of a batch, in plan order."""

    def __init__(self, entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype):
        counts: dict[tuple, int] = defaultdict(int)
        for e in entries:
            counts[e.batch_key(param_groups)] += matrix_count(e.param)
        self.batches = Batches(counts, ns_dtype, entries[0].param.device)
        self.views = [self.batches.take(e.batch_key(param_groups), matrix_count(e.param)).view(e.param.shape)
                      for e in entries]

    def orthogonalize(self) -> None:
        self.batches.orthogonalize()


class MuonLayout:
    """Kernel groups are (param group, matrix shape) segments, in that order:
    the momentum pass reads each group's momentum and nesterov, the update
    pass its lr and weight decay with the shape's lr ratio. Each entry's
    Newton-Schulz input and output is its view in ``matrices``: the momentum
    pass writes it, ``matrices.orthogonalize()`` orthogonalizes it in place
    and the update pass reads it."""

    def __init__(self, entries: list[Entry], param_groups: list[dict], ns_dtype: torch.dtype, key: tuple,
                 matrices=LocalMatrices):
        self.key = key
        entries = sorted(entries, key=lambda e: (e.group, matrix_shape(e.shape)))  # stable: group order kept
        self.entries = entries
        self.matrices = matrices(entries, param_groups, ns_dtype)
        views = self.matrices.views
        # Kernel groups: runs of one (param group, shape).
        self.segments: list[tuple[int, tuple[int, int]]] = []
        sizes: list[int] = []
        for e in entries:
            seg = (e.group, matrix_shape(e.shape))
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
        self.matrices.orthogonalize()
        kernels.muon_update(self.update_plan, lr=[g["lr"] for g in groups],
                            weight_decay=[g["weight_decay"] for g in groups],
                            lr_ratio=[lr_ratio(param_groups[gi]["adjust_lr_fn"], *shape)
                                      for gi, shape in self.segments],
                            found_inf=found_inf)


def matrix_count(t: torch.Tensor) -> int:
    """How many matrices a (local) Muon tensor holds."""
    return t.size(0) if t.ndim == 3 else 1
