"""The all-gather of DistributedFusedMuon's updated matrices: an AllGather
transport (_transport.py) that BucketGathers (_sync.py) drives bucket by
bucket, as it drives DistributedFusedAdam's parameter shards.

[Note: Muon buckets between iterations] A Muon bucket's buffers serve both
directions ([Note: matrix-atomic ownership] in _muon_owners.py): its slot
(``shard``) receives the owner's reduced gradients and then sends the
owner's updated matrices, and its ``full`` buffer stages the gradients and
then receives every owner's matrices. So a bucket whose all-gather is in
flight (overlap_param_sync leaves it running after step()) is not yet free
for the next iteration's gradients: landing it copies the other owners'
matrices into the parameters and zeroes ``full``, after which it is a
gradient bucket again. Whatever writes a bucket's buffers lands that bucket
first (OwnedMuon in _muon_owned.py).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ._muon_owners import OwnerBucket, matrix_in, matrix_of
from ._transport import AllGather, InFlight, _all_gather


class MatrixAllGather(AllGather):
    """Each bucket's slots, every owner's updated matrices, all-gathered over
    the owners' group into every rank's parameters."""

    def __init__(self, params: list[torch.Tensor], buckets: list[OwnerBucket], full: list[torch.Tensor],
                 shard: list[torch.Tensor], group, rank: int):
        self.params = params
        self.buckets = buckets
        self.full = full
        self.shard = shard
        self.group = group
        self.rank = rank

    @property
    def name(self) -> str:
        return f"{dist.get_backend(self.group)} all-gather of the Muon matrices"

    def gather(self, b: int) -> InFlight:
        # The engine's own work on parameters the first-use guard may have armed
        # ([Note: first-use guard] in _first_use.py): no subclass dispatch, and
        # outside autograd (a forward's wait lands buckets with grad enabled).
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            for m in self.buckets[b].owned_by(self.rank):
                matrix_in(self.shard[b], m).copy_(matrix_of(self.params[m.param], m))
        work = _all_gather(self.full[b], self.shard[b], group=self.group, async_op=True)
        return InFlight(work, then=functools.partial(self._land, b), what=f"{self.name} of bucket {b}")

    def _land(self, b: int) -> None:
        """The other owners' matrices into the parameters; ``full`` zeroed for
        the next gradients ([Note: Muon buckets between iterations])."""
        bucket, full = self.buckets[b], self.full[b]
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            for m in bucket.matrices:
                if m.owner != self.rank:
                    matrix_of(self.params[m.param], m).copy_(matrix_in(full, m, m.owner * bucket.slot_size))
        full.zero_()
