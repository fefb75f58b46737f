"""Which rank owns each Muon matrix, and where it lies in the gradient buckets.

[Note: matrix-atomic ownership] Adam is element-wise, so ZeRO may cut a
parameter anywhere; Muon orthogonalizes whole matrices, so
DistributedFusedMuon shards by matrix: each matrix (a 2-D parameter, or one
``p[i]`` of a 3-D one) is owned whole by one rank, which alone keeps its
momentum and runs its Newton-Schulz iteration. The buckets are laid out in
owner order: bucket b is ``world_size`` slots of ``slot_size`` elements, and
rank r's slot holds the matrices r owns, so one reduce-scatter of the bucket
hands every owner the summed gradients of its matrices, and one all-gather
of the slots hands every rank the owners' updated matrices. Within a bucket
the matrices go, largest Newton-Schulz cost first, to the rank with the least
cost so far over all buckets (cost ~ rows * cols * min(rows, cols), the
Gram matrix's multiply-adds), so each rank does about 1/N of the work and the
slots of a bucket are about the same size. Buckets follow the reverse of the
parameter order (the order backward usually produces gradients in) and hold
parameters of one dtype, up to ``cap`` elements (a larger parameter is a
bucket alone). The plan depends only on the shapes, dtypes, world size and
cap, so every rank computes the same one without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._newton_schulz import assign_owners, ns_cost

# Elements each matrix's start is aligned to in its slot (256 bytes of fp32):
# whole vectors for the kernels, whatever the shapes.
SLOT_ALIGN = 64


@dataclass(frozen=True)
class Matrix:
    """One matrix: parameter ``param`` itself (``index`` None, 2-D) or its
    ``param[index]`` (3-D); ``offset`` is its start in its owner's slot."""
    param: int
    index: int | None
    rows: int
    cols: int
    owner: int
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def cost(self) -> int:
        return ns_cost((self.rows, self.cols))


@dataclass
class OwnerBucket:
    params: list[int]  # parameter indices, in the order backward is expected to produce them
    dtype: torch.dtype
    slot_size: int     # elements of each rank's slot; the bucket has world_size of them
    matrices: list[Matrix] = field(default_factory=list)

    def owned_by(self, rank: int) -> list[Matrix]:
        return [m for m in self.matrices if m.owner == rank]


def matrix_in(flat: torch.Tensor, m: Matrix, base: int = 0) -> torch.Tensor:
    """m's place in a slot (flat), or in a bucket whose slot m lies in starts at base."""
    return flat[base + m.offset:base + m.offset + m.numel].view(m.rows, m.cols)


def matrix_of(p: torch.Tensor, m: Matrix) -> torch.Tensor:
    """m's matrix of its parameter p: p itself (2-D) or p[m.index] (3-D)."""
    return p if m.index is None else p[m.index]


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


def plan_owner_buckets(shapes: list[tuple], dtypes: list[torch.dtype], world_size: int,
                       cap: int) -> list[OwnerBucket]:
    """The buckets of parameters of these shapes (2-D or 3-D) and dtypes,
    their matrices' owners and slot offsets ([Note: matrix-atomic ownership])."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1 element, got {cap}")
    buckets: list[OwnerBucket] = []
    size = 0
    for k in reversed(range(len(shapes))):
        numel = 1
        for d in shapes[k]:
            numel *= d
        if not buckets or buckets[-1].dtype != dtypes[k] or size + numel > cap:
            buckets.append(OwnerBucket([], dtypes[k], 0))
            size = 0
        buckets[-1].params.append(k)
        size += numel
    load = [0] * world_size
    for bucket in buckets:
        pieces = []
        for k in bucket.params:
            shape = shapes[k]
            rows, cols = shape[-2], shape[-1]
            pieces += [(k, None, rows, cols)] if len(shape) == 2 else [(k, i, rows, cols) for i in range(shape[0])]
        owners = assign_owners([ns_cost(p[2:]) for p in pieces], load)
        used = [0] * world_size
        for (k, i, rows, cols), r in zip(pieces, owners):
            bucket.matrices.append(Matrix(k, i, rows, cols, r, used[r]))
            used[r] = _align(used[r] + rows * cols)
        bucket.slot_size = max(SLOT_ALIGN, max(used))
    return buckets
