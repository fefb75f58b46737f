"""torch.amp.GradScaler and the sharded optimizers (the ZeRO engine and
DistributedFusedMuon): the gradients live in the optimizer's shards, out of
the scaler's reach, so the optimizer unscales (inside its kernels' gradient
scale) and finds inf/NaN itself, on every rank alike, and tells the scaler.
The checks and conversions both optimizers make are here.

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


def check_stage(scaler, optimizer, unscaled_by_optimizer: bool, device) -> torch.Tensor | None:
    """step()'s check of the scaler's stage, before anything is written: 1 /
    its loss scale when the gradients are still scaled, None when the
    optimizer's unscale_grads() unscaled them (unscaled_by_optimizer) or
    without a scaler."""
    if scaler is None:
        return None
    unscaled = stage(scaler, optimizer) == "UNSCALED"
    if unscaled and not unscaled_by_optimizer:
        raise RuntimeError(f"scaler.unscale_(optimizer) cannot reach {type(optimizer).__name__}'s gradients "
                           "(they live in its buckets): call optimizer.unscale_grads(grad_scaler=scaler) "
                           "instead, or nothing (clip_grad_norm() and step() unscale by themselves)")
    if not unscaled and unscaled_by_optimizer:
        raise RuntimeError("the GradScaler steps gradients that unscale_grads(inv_scale=...) already "
                           "unscaled: they would be unscaled twice; use "
                           "unscale_grads(grad_scaler=scaler), or one of the two")
    return None if unscaled else inv_scale(scaler, device)


def requested_inv_scale(args: tuple, given, scaler, optimizer, already_unscaled: bool, device) -> torch.Tensor:
    """unscale_grads()'s arguments, checked: the inverse loss scale (given:
    its inv_scale, also its first positional argument, GradScaler.
    _unscale_grads_'s order; or 1 / the scaler's scale) as a float32 0-d
    tensor on `device`."""
    if args:
        if given is not None:
            raise TypeError("unscale_grads: inv_scale given both by position and by keyword")
        given = args[0]
    if (given is None) == (scaler is None):
        raise ValueError("unscale_grads needs exactly one of inv_scale or grad_scaler")
    if already_unscaled:
        raise RuntimeError("unscale_grads() was already called in this iteration (after the last step() or "
                           "zero_grad()): the gradients would be unscaled twice")
    if scaler is not None:
        now = stage(scaler, optimizer)
        if now != "READY":
            raise RuntimeError(f"unscale_grads(grad_scaler=...): the scaler is {now} for this optimizer "
                               "(unscale_ or step already ran since the last update())")
        given = inv_scale(scaler, device)
    return torch.as_tensor(given, dtype=torch.float32, device=device).reshape(())


def met(scaler, before):
    """The scaler a norm is unscaled with from now on: one handed to
    grad_norm() or clip_grad_norm() if enabled, else the one met before."""
    return scaler if scaler is not None and scaler.is_enabled() else before


def unscaled_norm(norm: torch.Tensor, inv: torch.Tensor | None, scaler, device) -> torch.Tensor:
    """A norm of the (loss-scaled) gradients, unscaled: by unscale_grads()'s
    factor inv when it ran, else by the scaler met (none, or one that has
    not scaled a loss yet: the gradients are not scaled)."""
    if inv is not None:
        return norm * inv
    if scaler is None or scaler._scale is None:
        return norm
    return norm * scaler._scale.to(device, torch.float32).reciprocal().reshape(())


def report(scaler, optimizer, found_inf: torch.Tensor, device, unscaled: bool = False) -> None:
    """Tell the scaler the optimizer's inf check, for update(), the way
    torch's fused optimizers do; unscaled: and that the optimizer unscaled
    (as scaler.unscale_(optimizer) leaves it)."""
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {device: found_inf}
    if unscaled:
        state["stage"] = OptState.UNSCALED


def fold_and_report(optimizer, inv: torch.Tensor, grad_scaler, device) -> dict:
    """unscale_grads()'s common end for both optimizers: fold inv into the
    next step, find inf/NaN on every rank, and with a scaler record it there
    as scaler.unscale_(optimizer) would; returns {device: found_inf}."""
    optimizer._fold_inv_scale(inv)
    found_inf = optimizer._nonfinite_on_any_rank()
    if grad_scaler is not None:
        optimizer._grad_scaler = grad_scaler
        report(grad_scaler, optimizer, found_inf, device, unscaled=True)
    return {device: found_inf}
