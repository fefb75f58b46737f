"""FusedMuon's parameter groups: Muon groups and AdamW groups (use_muon=False).

[Note: Muon and AdamW groups] Muon updates matrices; embeddings, heads,
biases and norms want AdamW. Keller Jordan's MuonWithAuxAdam marks each
param group with ``use_muon`` and steps the False ones by AdamW, so one
optimizer (one step, one state dict, one scheduler) trains a whole model.
FusedMuon follows that convention: a group without ``use_muon`` is a Muon
group (torch.optim.Muon's state dicts load as they are); a ``use_muon=False``
group takes AdamW's keys (lr, betas, eps, weight_decay), missing ones from
torch.optim.AdamW's defaults, and refuses Muon's.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import _muon_dtensor
from ._dtensor import is_dtensor, local
from ._newton_schulz import ADJUST_LR_FNS

MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
# torch.optim.AdamW's defaults, for the keys a use_muon=False group leaves out.
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
MUON_ONLY_KEYS = tuple(k for k in MUON_KEYS if k not in ADAMW_DEFAULTS)
MAX_NS_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100


def uses_muon(group: dict) -> bool:
    return bool(group.get("use_muon", True))


def _real(where: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _lr(where: str, value) -> None:
    """A number >= 0 or a one-element floating tensor (capturable keeps lr on
    the device; its value is not read)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{where}: lr must be a number or a one-element floating tensor, got a {value.dtype} "
                             f"tensor of {value.numel()} elements")
    elif _real(where, "lr", value) < 0.0:
        raise ValueError(f"{where}: lr must be >= 0, got {value}")


def _nonnegative(where: str, name: str, value) -> None:
    if _real(where, name, value) < 0.0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value}")


def _fraction(where: str, name: str, value) -> None:
    if not 0.0 <= _real(where, name, value) < 1.0:
        raise ValueError(f"{where}: {name} must be in [0, 1), got {value}")


def check_muon_hyper(where: str, group: dict) -> None:
    """A Muon group's (or the defaults') hyperparameters."""
    _lr(where, group["lr"])
    _nonnegative(where, "weight_decay", group["weight_decay"])
    _fraction(where, "momentum", group["momentum"])
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"{where}: nesterov must be True or False, got {group['nesterov']!r}")
    coefficients = group["ns_coefficients"]
    if isinstance(coefficients, (str, bytes)) or not hasattr(coefficients, "__len__") or len(coefficients) != 3:
        raise ValueError(f"{where}: ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
    for i, value in enumerate(coefficients):
        _real(where, f"ns_coefficients[{i}]", value)
    if _real(where, "eps", group["eps"]) <= 0.0:
        raise ValueError(f"{where}: eps must be > 0 (the Frobenius norm is clamped to it), got {group['eps']}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 <= steps < MAX_NS_STEPS:
        raise ValueError(f"{where}: ns_steps must be an int in [0, {MAX_NS_STEPS}), got {steps!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"{where}: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}")


def check_adamw_hyper(where: str, group: dict) -> None:
    """An AdamW group's hyperparameters."""
    _lr(where, group["lr"])
    betas = group["betas"]
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    _fraction(where, "betas[0]", betas[0])
    _fraction(where, "betas[1]", betas[1])
    _nonnegative(where, "eps", group["eps"])
    _nonnegative(where, "weight_decay", group["weight_decay"])


def check_group(where: str, group: dict) -> None:
    (check_muon_hyper if uses_muon(group) else check_adamw_hyper)(where, group)


def fill_adamw_group(where: str, group: dict) -> None:
    """A use_muon=False group as given: refuse Muon's keys, fill AdamW's
    defaults ([Note: Muon and AdamW groups])."""
    wrong = [k for k in MUON_ONLY_KEYS if k in group]
    if wrong:
        raise ValueError(f"{where} has use_muon=False (stepped by AdamW) but sets {wrong}, which only Muon groups "
                         "take; give it lr, betas, eps and weight_decay")
    for key, value in ADAMW_DEFAULTS.items():
        group.setdefault(key, value)
    group["betas"] = tuple(group["betas"]) if isinstance(group["betas"], list) else group["betas"]


def check_params(where: str, group: dict) -> None:
    """Muon groups take matrices (2-D) and batches of matrices (3-D: each
    matrix orthogonalized on its own); both kinds take floating tensors, plain
    or DTensors ([Note: Muon on sharded matrices] in _muon_dtensor.py)."""
    muon = uses_muon(group)
    for i, p in enumerate(group["params"]):
        at = f"{where}['params'][{i}]"
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"{at} is a {type(p).__name__}; pass tensors")
        if not p.is_floating_point() or p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{at} has dtype {p.dtype}; FusedMuon steps float32, bfloat16 and float16 tensors")
        if muon and p.ndim not in (2, 3):
            raise ValueError(f"{at} has shape {tuple(p.shape)}: Muon orthogonalizes matrices (2-D parameters, or "
                             "3-D ones as a batch of matrices); give it to a group with use_muon=False (AdamW)")
        if muon and p.numel() == 0:
            raise ValueError(f"{at} has shape {tuple(p.shape)}: an empty matrix has nothing to orthogonalize; "
                             "leave it out or give it to a group with use_muon=False")
        if is_dtensor(p):
            _muon_dtensor.check_param(at, p, muon)
        if p.is_sparse or p.layout != torch.strided or not local(p).is_contiguous():
            raise ValueError(f"{at} is not a dense contiguous tensor; the fused kernels need one "
                             "(pass p.contiguous() as the parameter)")


def add_group(optimizer, param_group: dict, check=None) -> dict:
    """torch.optim's add_param_group for a Muon optimizer's group: a
    use_muon=False group gets AdamW's defaults, not Muon's ([Note: Muon and
    AdamW groups]); then the group's checks and `check(where, group)`. A
    refused group leaves the optimizer as it was. Returns the added group."""
    where = f"param_groups[{len(optimizer.param_groups)}]"
    group = dict(param_group)
    if not uses_muon(group):
        fill_adamw_group(where, group)
    given = set(group)
    torch.optim.Optimizer.add_param_group(optimizer, group)
    group = optimizer.param_groups[-1]
    try:
        if not uses_muon(group):
            for key in set(optimizer.defaults) - given:  # torch.optim filled Muon's defaults in: not AdamW's
                del group[key]
        check_group(where, group)
        check_params(where, group)
        if check is not None:
            check(where, group)
    except ValueError:
        optimizer.param_groups.pop()
        raise
    return group
