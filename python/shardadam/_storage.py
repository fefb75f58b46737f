"""How stored optimizer state maps to its true fp32 values.

[Note: storage codecs] The optimizers keep each state and master in one of a
few storage kinds:

- plain: fp32 or bf16 values as they are (bf16 rounded to nearest even);
- scaled: fp16 holding value * scale, the scale a power of two per tensor
  (per shard fragment in the ZeRO engine) that puts the absolute maximum just
  under 2^15, so small values keep their precision; FP8 E4M3
  (torch.float8_e4m3fn, TransformerEngine's uint8 states) the same way with
  the maximum just under 2^8 (E4M3 reaches 448), always scaled;
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

from dataclasses import dataclass

import torch

from . import kernels

# The storage dtypes that carry a scale (FP8 always; fp16 unless apex's plain fp16 states).
SCALED_DTYPES = (torch.float16, torch.float8_e4m3fn)

# Where the exact master of a parameter lives.
PARAM = "param"            # the parameter (shard) itself is the master
SEPARATE = "separate"      # a master tensor of its own (fp32, or fp16 scaled), the parameter a rounded copy
REMAINDER = "remainder"    # the bf16 parameter plus an int16 remainder


@dataclass(frozen=True)
class StorageSpec:
    """What a set of parameters stores, in one vocabulary for both optimizers:
    FusedOptimizer's (master_weights / master_weight_dtype,
    store_param_remainders, exp_avg_dtype, ...) and apex's for the ZeRO engine
    (store_params=False: PARAM, store_param_remainders: REMAINDER,
    with_scaled_states: fp16 master and states). state_dtypes: (name, dtype)
    pairs; states not named are fp32. scaled_fp16: fp16 storage carries
    scales (False: plain fp16, apex's dtype=torch.float16 without scaled states)."""

    master: str = PARAM
    master_dtype: torch.dtype = torch.float32
    state_dtypes: tuple = ()
    scaled_fp16: bool = True

    def state_dtype(self, name: str) -> torch.dtype:
        """The AMSGrad maximum has no scale of its own: fp32 when exp_avg_sq is
        fp16 (small values would underflow), else like exp_avg_sq."""
        dtypes = dict(self.state_dtypes)
        if name == "max_exp_avg_sq":
            sq = dtypes.get("exp_avg_sq", torch.float32)
            return torch.float32 if sq in SCALED_DTYPES else sq
        return dtypes.get(name, torch.float32)

    def allocate(self, rule, size, scale_count: int, device) -> "Stored":
        """Zeroed buffers of `size` for the rule's states and the master, and
        scale_count ones for each fp16 one (a scale per tensor or fragment)."""
        states = {name: torch.zeros(size, dtype=self.state_dtype(name), device=device) for name in rule.states}
        master = torch.zeros(size, dtype=self.master_dtype, device=device) if self.master == SEPARATE else None
        remainders = torch.zeros(size, dtype=torch.int16, device=device) if self.master == REMAINDER else None
        scaled = [name for name in rule.scalable if states[name].dtype == torch.float8_e4m3fn
                  or (self.scaled_fp16 and states[name].dtype == torch.float16)]
        if self.scaled_fp16 and master is not None and master.dtype == torch.float16:
            scaled.append("master")
        scales = {name: torch.ones(scale_count, dtype=torch.float32, device=device) for name in scaled}
        return Stored(states, scales, master, remainders)


@dataclass
class Stored:
    """Buffers a StorageSpec allocated: the rule's states by name, the
    per-tensor (or per-fragment) scales of the fp16 ones ("master" too), the
    separate master or the remainders (None where the spec has none)."""

    states: dict
    scales: dict
    master: torch.Tensor | None
    remainders: torch.Tensor | None


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
        factor = kernels.pow2_scale_for(float(values.abs().max()) if values.numel() else 0.0, 1.0, stored.dtype)
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
