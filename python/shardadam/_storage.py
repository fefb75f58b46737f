"""How stored optimizer state maps to its true fp32 values.

[Note: storage codecs] The optimizers keep each state and master in one of a
few storage kinds:

- plain: fp32 or bf16 values as they are (bf16 rounded to nearest even);
- scaled: fp16 holding value * scale, the scale a power of two per tensor
  (per shard fragment in the ZeRO engine) that puts the absolute maximum just
  under 2^15, so small values keep their precision; FP8 E4M3
  (torch.float8_e4m3fn, TransformerEngine's uint8 states) the same way with
  the maximum just under 2^8 (E4M3 reaches 448), always scaled;
- blockwise 8-bit (BLOCKWISE8, states only): uint8 codes of a dynamic map
  (signed for exp_avg, unsigned for exp_avg_sq) times a float32 maximum per
  block of 256 elements ([Note: blockwise 8-bit states] in cpp/dtype.h);
  the maxima live in a flat buffer beside the codes, one slice per tensor
  (per shard fragment in the ZeRO engine);
- remainder master: a bf16 parameter (the high half, rounded) and an int16
  low half that together are an exact fp32 master;
- parameter as master (store_params=False): the parameter shard itself.

The update kernels read and write them in place. Everything else that needs
true values (the fused optimizers' buckets and checkpoints, the ZeRO shards,
the portable checkpoint and DCP) goes through the functions here, and the bit
math is the core's own (kernels.join_remainders, kernels.split_remainders,
kernels.pow2_scale_for, kernels.blockwise_quantize / blockwise_dequantize:
what the kernels use), never re-written in Python.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from ._torch import blocks_of

# The storage dtypes that carry a scale (FP8 always; fp16 unless apex's plain fp16 states).
SCALED_DTYPES = (torch.float16, torch.float8_e4m3fn)

# The blockwise 8-bit storage kind, as the optimizers' exp_avg_dtype /
# exp_avg_sq_dtype name it; stored as uint8 codes with block maxima.
BLOCKWISE8 = "blockwise8"
# States kept in the unsigned map (their values are never negative).
UNSIGNED_STATES = ("exp_avg_sq",)


# [Note: FP8 second moments] An FP8 E4M3 exp_avg_sq under one scale per
# tensor does not train: squared gradients span more than E4M3's 2^17 below
# the tensor's maximum, entries that round to zero take lr-sized steps
# (m / (0 + eps)), and the loss diverged (NaN within 50 steps on a 25M GPT,
# +12.7% on the example GPT). Its 3 mantissa bits cannot follow beta2's 0.1%
# decay either: 0.999 * v rounds back to v. So an exp_avg_sq asked for in FP8
# (torch.float8_e4m3fn, or torch.uint8 as TransformerEngine spells it) is kept
# in the blockwise 8-bit code instead: still one byte per element, plus one
# float32 maximum per 256 elements, whose unsigned map spends its codes over
# seven decades below each block's maximum, and whose exact fp32 maxima let a
# decaying block decay. FP8 exp_avg keeps E4M3 with its per-tensor scale (it
# trains: its values are gradients, not their squares). Checkpoints hold true
# fp32 values either way.
def state_storage(name: str, dtype):
    """The storage kind of optimizer state `name` asked for as `dtype` (a
    torch dtype or BLOCKWISE8): TransformerEngine's torch.uint8 is FP8 E4M3,
    and an FP8 second moment is kept blockwise ([Note: FP8 second moments])."""
    dtype = torch.float8_e4m3fn if dtype == torch.uint8 else dtype
    if dtype == torch.float8_e4m3fn and name in UNSIGNED_STATES:
        return BLOCKWISE8
    return dtype


def codec(views: dict, name: str) -> dict:
    """How state `name` of one parameter is stored, as true_values and store
    take it: its per-tensor scale, or its block maxima (views name_scale,
    name_absmax), and which map."""
    return dict(scale=views.get(name + "_scale"), absmax=views.get(name + "_absmax"),
                signed=name not in UNSIGNED_STATES)

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
        fp16 (small values would underflow) or blockwise, else like
        exp_avg_sq. A torch dtype, or BLOCKWISE8."""
        dtypes = dict(self.state_dtypes)
        if name == "max_exp_avg_sq":
            sq = dtypes.get("exp_avg_sq", torch.float32)
            return torch.float32 if sq in SCALED_DTYPES or sq == BLOCKWISE8 else sq
        return dtypes.get(name, torch.float32)

    def allocate(self, rule, size, scale_count: int, device, block_count: int = 0) -> "Stored":
        """Zeroed buffers of `size` for the rule's states and the master,
        scale_count ones for each fp16 one (a scale per tensor or fragment),
        and block_count zeroed maxima for each blockwise one (the sum of
        blocks_of over its tensors or fragments)."""
        kinds = {name: self.state_dtype(name) for name in rule.states}
        states = {name: torch.zeros(size, dtype=torch.uint8 if kind == BLOCKWISE8 else kind, device=device)
                  for name, kind in kinds.items()}
        blocks = {name: torch.zeros(block_count, dtype=torch.float32, device=device)
                  for name, kind in kinds.items() if kind == BLOCKWISE8}
        master = torch.zeros(size, dtype=self.master_dtype, device=device) if self.master == SEPARATE else None
        remainders = torch.zeros(size, dtype=torch.int16, device=device) if self.master == REMAINDER else None
        scaled = [name for name in rule.scalable if kinds[name] == torch.float8_e4m3fn
                  or (self.scaled_fp16 and kinds[name] == torch.float16)]
        if self.scaled_fp16 and master is not None and master.dtype == torch.float16:
            scaled.append("master")
        scales = {name: torch.ones(scale_count, dtype=torch.float32, device=device) for name in scaled}
        return Stored(states, scales, master, remainders, blocks)


@dataclass
class Stored:
    """Buffers a StorageSpec allocated: the rule's states by name, the
    per-tensor (or per-fragment) scales of the fp16 ones ("master" too), the
    separate master or the remainders (None where the spec has none), the
    flat block maxima of the blockwise states by name."""

    states: dict
    scales: dict
    master: torch.Tensor | None
    remainders: torch.Tensor | None
    blocks: dict


def block_views(flat: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Consecutive slices of a flat block-maxima buffer, one per tensor of numels elements."""
    views, start = [], 0
    for n in numels:
        count = blocks_of(n)
        views.append(flat[start:start + count])
        start += count
    return views


def true_values(stored: torch.Tensor, scale: torch.Tensor | None = None, absmax: torch.Tensor | None = None,
                signed: bool = True) -> torch.Tensor:
    """A new fp32 tensor of the values a plain (scale and absmax None), scaled
    or blockwise (codes with their block maxima `absmax`) tensor holds."""
    if absmax is not None:
        values = torch.empty_like(stored, dtype=torch.float32)  # the same memory order: blocks follow it
        kernels.blockwise_dequantize(stored, absmax, values, signed=signed)
        return values
    values = stored.to(torch.float32, copy=True)
    return values.div_(scale.to(values.device, torch.float32)) if scale is not None else values


def store(stored: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None = None,
          absmax: torch.Tensor | None = None, signed: bool = True) -> None:
    """Write true values into a plain tensor, into a scaled one (`scale`, a
    one-element tensor, then gets the scale the kernels would choose for these
    values), or into blockwise codes and their block maxima `absmax`."""
    if absmax is not None:
        ordered = torch.empty_like(stored, dtype=torch.float32)
        ordered.copy_(values)
        kernels.blockwise_quantize(ordered, stored, absmax, signed=signed)
        return
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
