"""Parameter-group helpers shared by the fused and the distributed optimizers."""
from __future__ import annotations

import torch


def run_closure(closure):
    """torch.optim's contract: re-evaluate the loss with gradients enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_step_groups(param_groups: list[dict], rule) -> None:
    """Every group's hyperparameters, by the update rule's checks, before a
    step changes anything (a scheduler or the caller may have set them since
    the last step). O(groups)."""
    for i, g in enumerate(param_groups):
        rule.check_group(f"param_groups[{i}]", g)


def pack_groups(param_groups: list[dict], plain=lambda v: v) -> tuple[list[dict], dict]:
    """State-dict groups (parameters as indices in param_groups order, other
    values through `plain`) and the index of every parameter by id."""
    index, groups = {}, []
    for g in param_groups:
        packed = {k: plain(v) for k, v in g.items() if k != "params"}
        packed["params"] = []
        for p in g["params"]:
            index[id(p)] = len(index)
            packed["params"].append(index[id(p)])
        groups.append(packed)
    return groups, index


def plain_value(x):
    """A group value as a Python number (capturable optimizers keep lr and
    step in device tensors; checkpoints hold numbers)."""
    if isinstance(x, torch.Tensor):
        value = x.item()
        return int(value) if float(value).is_integer() else value
    return x


def set_group_values(group: dict, values: dict) -> None:
    """Set loaded values into a live group; device tensors (capturable lr and
    step) are filled in place, since a captured graph reads their memory."""
    for k, v in values.items():
        if isinstance(group.get(k), torch.Tensor):
            group[k].fill_(float(v))
        else:
            group[k] = v


def param_names(param_groups: list[dict]) -> dict[int, str]:
    """How errors name each parameter, by id, in param_groups order:
    ``param_groups[g]['params'][i]``."""
    return {id(p): f"param_groups[{gi}]['params'][{pi}]" for gi, g in enumerate(param_groups)
            for pi, p in enumerate(g["params"])}
