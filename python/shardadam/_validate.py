"""Checks of hyperparameter values, shared by the kernels, the optimizers'
step() and every load_state_dict, so that each refuses the same values with
the same words before anything is written.

[Note: validate, then mutate] Every public entry point that writes (a step, a
state-dict load, a kernel launch) first runs every check that can fail, and
only then changes tensors, counters or groups: a refusal leaves the optimizer
exactly as it was. Values held in device tensors (capturable lr and step,
GradScaler's scale) are not read back to be checked: that would be a host
sync per step; the README's "Guarantees" says so.
"""
from __future__ import annotations

import math
import numbers

import torch


def _number(where: str, name: str, value) -> float:
    """A real, finite Python number (bools and strings are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be finite, got {value}")
    return value


def check_nonnegative(where: str, name: str, value, *, tensor_ok: bool = False) -> None:
    """A finite number >= 0, or (tensor_ok) a one-element floating tensor,
    whose value is not read (it may live on a device)."""
    if tensor_ok and isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{where}: {name} must be a number or a one-element floating tensor, got a "
                             f"{value.dtype} tensor of {value.numel()} elements")
        return
    if _number(where, name, value) < 0.0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value}")


def check_beta(where: str, name: str, value) -> None:
    if not 0.0 <= _number(where, name, value) < 1.0:
        raise ValueError(f"{where}: {name} must be in [0, 1), got {value}")


def check_betas(where: str, betas) -> None:
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    check_beta(where, "betas[0]", betas[0])
    check_beta(where, "betas[1]", betas[1])


def check_adam_group(where: str, group: dict) -> None:
    """lr, betas, eps, weight_decay of one Adam parameter group (or a
    defaults dict): finite and in range; lr may be a one-element tensor
    (capturable optimizers and LR schedulers keep it there)."""
    check_nonnegative(where, "lr", group["lr"], tensor_ok=True)
    check_betas(where, group["betas"])
    check_nonnegative(where, "eps", group["eps"])
    check_nonnegative(where, "weight_decay", group["weight_decay"])


def check_lion_group(where: str, group: dict) -> None:
    """lr, betas, weight_decay of one Lion parameter group (or a defaults
    dict): finite and in range; lr may be a one-element tensor."""
    check_nonnegative(where, "lr", group["lr"], tensor_ok=True)
    check_betas(where, group["betas"])
    check_nonnegative(where, "weight_decay", group["weight_decay"])


# ---------------------------------------------------------------- kernel hyperparameters
#
# The kernels take lr, step and grad_scale (and scale's factor) either as
# Python numbers, checked here, or as one-element tensors that the kernel
# reads on the device: those are never read back (no host sync, CUDA-graph
# capturable), so their values are not checked. beta1, beta2, eps and
# weight_decay are host numbers only.

def check_host_number(where: str, name: str, value) -> float:
    """A finite real Python number (numbers.Real: int, float, numpy scalars;
    bools, strings and tensors are refused with TypeError)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a Python number, got a tensor (only lr, step and grad_scale "
                        "may be tensors, read by the kernel on the device)")
    return _number(where, name, value)


def check_finite(where: str, name: str, value) -> None:
    """A finite number of any sign (kernels.scale's factor)."""
    _number(where, name, value)


def check_positive(where: str, name: str, value) -> None:
    """A finite number > 0 (grad_scale: a multiplier of the gradients;
    torch.amp.GradScaler's scales and their inverses are always positive)."""
    if not _number(where, name, value) > 0.0:
        raise ValueError(f"{where}: {name} must be > 0 (it multiplies every gradient), got {value}")


def check_update_step(where: str, name: str, value, bias_correction: bool) -> None:
    """kernels.adam's step, the number of this update: finite, and >= 1 when
    bias correction divides by 1 - beta**step."""
    if not _number(where, name, value) >= 1.0 and bias_correction:
        raise ValueError(f"{where}: {name} must be >= 1 (the number of this update) with bias correction, "
                         f"got {value}")


def check_step_count(where: str, name: str, value) -> int:
    """A step counter as a Python int: an integer-valued finite number >= 0,
    or a one-element real tensor holding one (torch.optim keeps a float32
    tensor per parameter). Read once, at load time."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta" or value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where}: {name} must be a number or a one-element real tensor, got a "
                             f"{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)} "
                             f"on {value.device}")
        value = value.item()
    try:
        number = _number(where, name, value)
    except TypeError as e:
        raise ValueError(str(e)) from None
    if number < 0 or not number.is_integer():
        raise ValueError(f"{where}: {name} must be a whole number >= 0 (steps taken), got {value!r}")
    return int(number)


def check_flag(where: str, name: str, value) -> bool:
    """A boolean option (True/False, or apex's 0/1)."""
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
