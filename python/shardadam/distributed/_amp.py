"""torch.amp.GradScaler and the ZeRO engine: the gradients live in the
optimizer's shards, out of the scaler's reach, so the optimizer unscales
(inside its kernel's gradient scale) and finds inf/NaN itself, on every rank
alike, and tells the scaler.

[Note: GradScaler protocols] GradScaler.step(opt) has two ways to step an
optimizer with _step_supports_amp_scaling. The old one passes
``grad_scaler=self`` when step()'s signature names it, and warns
(FutureWarning) that it is going away. The newer one sets
``opt.grad_scale`` / ``opt.found_inf`` for the duration of step(), after its
own inf check over ``p.grad`` (empty or partial here: the gradients were
handed over), and never hands over the scaler, whose update() then needs
``found_inf_per_device`` filled. step() takes grad_scaler through **kwargs,
so the scaler uses the newer protocol (no warning), and finds the scaler
stepping it among its callers' frames (GradScaler.step's ``self``) to
report the inf check it made on the reduced gradients. step(grad_scaler=...)
as apex calls it keeps working.
"""
from __future__ import annotations

import sys

import torch
from torch.amp.grad_scaler import OptState

_CALLER_DEPTH = 8  # GradScaler.step -> torch's step wrappers (profiling, hooks) -> step()


def stepping_scaler(optimizer, kwargs: dict):
    """The GradScaler stepping `optimizer`: step()'s grad_scaler keyword, or
    the caller of the newer protocol; None without one. TypeError for any
    other keyword."""
    scaler = kwargs.pop("grad_scaler", None)
    if kwargs:
        raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
    if scaler is not None or not hasattr(optimizer, "found_inf"):
        return scaler
    frame = sys._getframe(2)
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, torch.amp.GradScaler) and id(optimizer) in candidate._per_optimizer_states:
            return candidate
        frame = frame.f_back
    raise RuntimeError(f"{type(optimizer).__name__}.step() was called with found_inf set (torch.amp.GradScaler's "
                       "newer protocol) but no GradScaler.step() among its callers: call "
                       "step(grad_scaler=scaler) to hand the scaler over")


def stage(scaler, optimizer) -> str:
    """The scaler's stage for this optimizer: READY, UNSCALED or STEPPED."""
    return scaler._per_optimizer_states[id(optimizer)]["stage"].name


def inv_scale(scaler, device) -> torch.Tensor:
    """1 / the scaler's current loss scale, float32 on `device`."""
    if scaler._scale is None:
        raise RuntimeError("the GradScaler has not scaled a loss yet (scaler.scale(loss) first)")
    return scaler._scale.to(device, torch.float32).reciprocal().reshape(())


def report(scaler, optimizer, found_inf: torch.Tensor, device, unscaled: bool = False) -> None:
    """Tell the scaler the optimizer's inf check, for update(), the way
    torch's fused optimizers do; unscaled: and that the optimizer unscaled
    (as scaler.unscale_(optimizer) leaves it)."""
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {device: found_inf}
    if unscaled:
        state["stage"] = OptState.UNSCALED
