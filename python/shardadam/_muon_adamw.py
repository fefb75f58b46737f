"""FusedMuon's AdamW groups (use_muon=False) on one device, on the fused
Adam kernel ([Note: Muon and AdamW groups] in _muon_groups.py).

The state is torch.optim.AdamW's: ``exp_avg``, ``exp_avg_sq`` and a float32
``step`` tensor per parameter (on the parameter's device when capturable,
else on the CPU).

[Note: shared step counters] The kernel takes one step counter per kernel
group, and a parameter's counter advances only on steps where it has a
gradient (as torch.optim.AdamW's). Parameters of one param group whose
counters agree share one tensor, so a step advances each shared counter once
and launches one kernel group per counter, not per parameter. When only some
holders of a counter step, the others get their own copy first; a loaded
state dict is merged back into shared counters. Counters are never shared
across devices (a step advances each device's layout's counters). state_dict() hands out one
copy per parameter, so the counters it returns are torch.optim.AdamW's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from ._dtensor import local

GRADS = 1  # the gradient list's index in an update plan


@dataclass
class Entry:
    """One stepping AdamW parameter: the tensors the kernels step (a DTensor
    parameter's local pieces; its states, DTensors, are read through local())."""
    group: int
    param: torch.Tensor
    grad: torch.Tensor
    state: dict


def new_step_counter(device: torch.device | None) -> torch.Tensor:
    """torch.optim.AdamW's step counter: float32, on the CPU unless capturable."""
    return torch.zeros((), dtype=torch.float32, device=device)


def split_shared_counters(group_states: list[dict], stepping: set[int]) -> None:
    """Give the holders of a shared counter that do not step this time their
    own copy ([Note: shared step counters]). group_states: the states of one
    param group's parameters that have state; stepping: ids of those states
    that step."""
    holders: dict[int, list[dict]] = {}
    for st in group_states:
        holders.setdefault(id(st["step"]), []).append(st)
    for states in holders.values():
        idle = [st for st in states if id(st) not in stepping]
        if idle and len(idle) < len(states):
            copy = states[0]["step"].clone()
            for st in idle:
                st["step"] = copy


def merge_equal_counters(group_states: list[dict], device: torch.device | None) -> None:
    """After a load: one shared counter per distinct value among the states
    of one param group's parameters on one device, on `device` (None: the
    CPU). Reads the values (a host sync, at load time)."""
    by_value: dict[float, torch.Tensor] = {}
    for st in group_states:
        value = float(st["step"])
        if value not in by_value:
            by_value[value] = torch.tensor(value, dtype=torch.float32, device=device)
        st["step"] = by_value[value]


def layout_key(entries: list[Entry]) -> tuple:
    return tuple((e.group, id(e.param), e.param.data_ptr(), e.grad.dtype, id(e.state["step"]),
                  local(e.state["exp_avg"]).data_ptr(), local(e.state["exp_avg_sq"]).data_ptr()) for e in entries)


class AdamWLayout:
    """One AdamPlan over the stepping parameters of one device, kernel groups
    being (param group, shared step counter) runs."""

    def __init__(self, entries: list[Entry], key: tuple):
        self.key = key
        order: dict[tuple, int] = {}
        for e in entries:
            order.setdefault((e.group, id(e.state["step"])), len(order))
        entries = sorted(entries, key=lambda e: order[(e.group, id(e.state["step"]))])
        self.entries = entries
        self.segments: list[tuple[int, torch.Tensor]] = []
        sizes: list[int] = []
        for e in entries:
            if not self.segments or self.segments[-1][1] is not e.state["step"] or self.segments[-1][0] != e.group:
                self.segments.append((e.group, e.state["step"]))
                sizes.append(0)
            sizes[-1] += 1
        self.plan = kernels.AdamPlan([e.param for e in entries], [e.grad for e in entries],
                                     [local(e.state["exp_avg"]) for e in entries],
                                     [local(e.state["exp_avg_sq"]) for e in entries],
                                     group_sizes=sizes)
        self.plan.release_read_list(GRADS)

    def counters(self) -> list[torch.Tensor]:
        """The step counters this layout advances, once each."""
        return [counter for _, counter in self.segments]

    def step(self, grads_by_param: dict, param_groups: list[dict], *, grad_scale, found_inf,
             unscale_grads: bool) -> None:
        """One AdamW step (torch.optim.AdamW's math); the counters were advanced by the caller."""
        groups = [param_groups[g] for g, _ in self.segments]
        self.plan.refresh_read_list(GRADS, [grads_by_param[id(e.param)] for e in self.entries])
        try:
            kernels.adam(self.plan, lr=[g["lr"] for g in groups], step=self.counters(),
                         beta1=[g["betas"][0] for g in groups], beta2=[g["betas"][1] for g in groups],
                         eps=[g["eps"] for g in groups], weight_decay=[g["weight_decay"] for g in groups],
                         adam_w_mode=True, bias_correction=True, grad_scale=grad_scale, found_inf=found_inf,
                         unscale_grads=unscale_grads)
        finally:
            self.plan.release_read_list(GRADS)
