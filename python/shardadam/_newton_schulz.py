"""Muon's orthogonalization: the Newton-Schulz iteration, batched over
matrices of one shape, and the shape's learning-rate adjustment.

[Note: batched Newton-Schulz] torch.optim.Muon orthogonalizes one matrix at
a time (a chain of 3 * ns_steps small matmuls per parameter). FusedMuon
stacks every matrix of one shape (2-D parameters, and each matrix of a 3-D
parameter such as a mixture-of-experts weight) into one [n, rows, cols]
buffer and runs one chain of batched matmuls over it, in the same dtype
torch uses (bf16): the same arithmetic per matrix, 3 * ns_steps launches per
shape instead of per parameter. The momentum pass writes the stacked input
and the update pass reads the result in place (cpp/muon_math.h), so nothing
is stacked or unstacked by copies.
"""
from __future__ import annotations

import math

import torch

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz_(x: torch.Tensor, coefficients, steps: int, eps: float) -> None:
    """Orthogonalize each matrix of x ([n, rows, cols]) in place, as
    torch.optim.Muon's _zeropower_via_newtonschulz does for one: work on the
    wide orientation (rows <= cols), divide by the Frobenius norm (at least
    eps), then `steps` quintic iterations X = a X + (b A + c A A) X with
    A = X X^T, in x's dtype. No host synchronisation (CUDA-graph safe)."""
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    y = x.mT if tall else x
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, poly, y, beta=a)
    x.copy_(y.mT if tall else y)


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The factor torch.optim.Muon's _adjust_lr applies to lr for a matrix of
    rows x cols (for a 3-D parameter, each of its matrices: the last two
    dimensions): "original" (the default) sqrt(max(1, rows / cols)), Keller
    Jordan's; "match_rms_adamw" 0.2 * sqrt(max(rows, cols)), Moonshot's, which
    gives the update AdamW's RMS so AdamW's lr and weight decay carry over."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def ns_cost(shape) -> int:
    """Newton-Schulz's work on one matrix of this shape (rows x cols: the
    last two dimensions), in units that rank matrices: rows * cols *
    min(rows, cols), the Gram products' multiply-adds per iteration."""
    rows, cols = shape[-2], shape[-1]
    return rows * cols * min(rows, cols)


def assign_owners(costs: list[int], loads: list[int]) -> list[int]:
    """The owner rank of each matrix by its cost: largest first, onto the
    least loaded rank (ties: the lower rank, then the earlier matrix).
    ``loads`` holds each rank's work so far and is updated in place."""
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += costs[j]
    return owners
