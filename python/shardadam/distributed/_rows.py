"""[Note: sync classes] Parameters of one DistributedFusedAdam may travel in
different dtypes: each trainable parameter has a sync class, its
(grad_sync_dtype, param_sync_dtype) pair (the constructor's, or its own dtype
by default, or what apex's init_params(..., grad_sync_dtype=,
param_sync_dtype=) gave it before it was started). Each class is a key of the
bucket layout, so a bucket holds one class and travels in its dtypes.

Every key gets one bucket size (the layout is built with one element size
for all keys: the largest gradient dtype's), so the optimizer state stays
one [buckets, shard] tensor per state in the state's dtype, indexed by the
global bucket number. What is stored in a sync dtype (reduced gradient
shards, parameter shards, the contiguous buffers) is BucketRows: one
[buckets of the key, row] tensor per key, and row b the row of bucket b in
its key's tensor. A parameter's fragments lie in consecutive buckets of its
key, so within its key's tensor they follow each other and a contiguous
buffer can hold the parameter (or its gradient) as one view.
"""
from __future__ import annotations

import torch

__all__ = ["BucketRows"]


class BucketRows:
    """Row b of a per-bucket buffer, each row in its bucket's dtype.

    tensors: the backing tensors (what whole-buffer operations and memory
    counts act on); rows[b]: bucket b's row, a view into one of them."""

    def __init__(self, tensors: list[torch.Tensor], rows: list[torch.Tensor]):
        self.tensors = tensors
        self.rows = rows

    @classmethod
    def allocate(cls, buckets: list, size: int, dtype_of_key: dict, device, factory=torch.zeros) -> BucketRows:
        """[count of key, size] per key, in that key's dtype (a key whose
        parameters have no elements has no buckets: an empty tensor)."""
        counts = dict.fromkeys(dtype_of_key, 0)
        for bucket in buckets:
            counts[bucket.key] += 1
        tensors = {key: factory(n, size, dtype=dtype_of_key[key], device=device) for key, n in counts.items()}
        return cls(list(tensors.values()), [tensors[bucket.key][bucket.index] for bucket in buckets])

    @classmethod
    def of(cls, tensor: torch.Tensor) -> BucketRows:
        """The rows of one [buckets, size] tensor (every bucket in its dtype)."""
        return cls([tensor], list(tensor.unbind(0)))

    def __getitem__(self, where):
        """rows[b], or rows[b, columns] as a tensor indexes."""
        if isinstance(where, tuple):
            b, columns = where
            return self.rows[b][columns]
        return self.rows[where]

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self, columns: slice) -> BucketRows:
        """The same columns of every row (views): this rank's shard of full buckets."""
        return BucketRows([t[:, columns] for t in self.tensors], [row[columns] for row in self.rows])

    @property
    def single(self) -> torch.Tensor | None:
        """The one [buckets, size] tensor when every bucket shares it, else None."""
        return self.tensors[0] if len(self.tensors) == 1 and len(self.tensors[0]) == len(self.rows) else None

    @property
    def blocks(self) -> list[torch.Tensor]:
        """The fewest contiguous tensors that hold every row: the backing
        tensors, or the rows where those are column slices."""
        return self.tensors if all(t.is_contiguous() for t in self.tensors) else self.rows

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def zero_(self) -> None:
        for t in self.tensors:
            t.zero_()
