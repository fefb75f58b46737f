"""How stored optimizer state maps to its true fp32 values.

[Note: storage codecs] The optimizers keep each state and master in one of a
few storage kinds:

- plain: fp32 or bf16 values as they are (bf16 rounded to nearest even);
- scaled: fp16 holding value * scale, the scale a power of two per tensor
  (per shard fragment in the ZeRO engine) that puts the absolute maximum just
  under 2^15, so small values keep their precision;
- remainder master: a bf16 parameter (the high half, rounded) and an int16
  low half that together are an exact fp32 master;
- parameter as master (store_params=False): the parameter shard itself.

The update kernels read and write them in place. Everything else that needs
true values (the fused optimizers' buckets and checkpoints, the ZeRO shards,
the portable checkpoint and DCP) goes through the functions here, and the bit
math is the core's own (kernels.join_remainders, kernels.split_remainders,
kernels.pow2_scale_for: what the kernels use), never re-written in Python.
"""
from __future__ import annotations

import torch

from . import kernels


def true_values(stored: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A new fp32 tensor of the values a plain (scale None) or scaled tensor holds."""
    values = stored.to(torch.float32, copy=True)
    return values.div_(scale.to(values.device, torch.float32)) if scale is not None else values


def store(stored: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """Write true values into a plain tensor, or into a scaled one: `scale`
    (a one-element tensor) then gets the scale the kernels would choose for
    these values."""
    values = values.to(device=stored.device, dtype=torch.float32)
    if scale is not None:
        factor = kernels.pow2_scale_for(float(values.abs().max()) if values.numel() else 0.0)
        scale.fill_(factor)
        values = values * factor
    stored.copy_(values)


def joined_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The exact fp32 master a bf16 parameter and its int16 remainder make (a new tensor)."""
    master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    kernels.join_remainders(param.contiguous(), remainder.contiguous(), master)
    return master


def split_master(values: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Store an fp32 master as a bf16 parameter (rounded) and its int16 remainder, in place."""
    values = values.to(device=param.device, dtype=torch.float32).contiguous()
    if param.is_contiguous() and remainder.is_contiguous():
        kernels.split_remainders(values, param, remainder)
        return
    hi, lo = torch.empty_like(values, dtype=torch.bfloat16), torch.empty_like(values, dtype=torch.int16)
    kernels.split_remainders(values, hi, lo)
    param.copy_(hi)
    remainder.copy_(lo)
