"""The gradient reduce-scatter on the copy engines (distributed/_peer.py).

NCCL's reduce-scatter overlaps backward as kernels that hold SMs for as long
as the transfer lasts, and backward's matmuls slow down around them. Here
each rank writes piece q of a bucket straight into rank q's receive slot on
the copy engines; rank q adds what it received to its own piece with one
short kernel. Two counters order it:

- ARRIVED, raised on the receiver after a sender's write of a bucket: the add
  waits until every peer's piece arrived;
- FREED, raised after the add, on every rank (this one too): a sender waits
  until the receiver has added a slot's last contents before writing into it
  again, and the caller's wait (the pipeline's) orders what reads the reduced
  shard, or reuses the bucket's memory, after this rank's copies and add.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._peer import CounterWork, PeerBuffers, PeerCounters, connect_with_counters

ARRIVED, FREED = 0, 1


class PeerGradReduce:
    """Reduce-scatters of buckets [world * shard] into shards [shard] (sums),
    through ``depth`` receive slots of [world - 1, shard] per rank used in turn."""

    def __init__(self, slots: PeerBuffers, counters: PeerCounters, depth: int):
        self.slots = slots
        self.counters = counters
        self.depth = depth
        self.rank, self.world = slots.rank, slots.world
        self.calls = 0

    @classmethod
    def connect(cls, shard: int, dtype: torch.dtype, device: torch.device, group, depth: int = 2):
        """A collective over group; None (on every rank) where the copy engines cannot be used."""
        receive = torch.empty(depth, dist.get_world_size(group) - 1, shard, dtype=dtype, device=device)
        connected = connect_with_counters(receive, group, kinds=2)
        return None if connected is None else cls(*connected, depth)

    def reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor) -> CounterWork:
        """out = the sum over ranks of their piece ``rank`` of bucket; every
        rank calls this for the same buckets in the same order."""
        n, self.calls = self.calls, self.calls + 1
        slot = n % self.depth
        stream, receive = self.slots.stream, self.slots.tensor
        stream.wait_stream(torch.cuda.current_stream(out.device))  # the bucket is packed
        if n >= self.depth:  # every receiver has added what this rank last wrote into this slot
            self.counters.wait_for_peers(FREED, n - self.depth + 1, stream)
        pieces = bucket.view(self.world, -1)
        row_bytes = receive.stride(1) * receive.element_size()
        for r in range(self.world):
            if r != self.rank:  # this rank's row among r's senders
                row = slot * (self.world - 1) + self.rank - (self.rank > r)
                self.slots.write(r, row * row_bytes, pieces[r])
        self.counters.raise_on_peers(ARRIVED, n + 1)
        self.counters.wait_for_peers(ARRIVED, n + 1, stream)
        with torch.cuda.stream(stream):
            received = receive[slot]
            if self.world == 2:
                torch.add(pieces[self.rank], received[0], out=out)
            else:
                torch.sum(received, dim=0, out=out)
                out.add_(pieces[self.rank])
        self.counters.raise_on_peers(FREED, n + 1, and_self=True)
        return CounterWork(self.counters, FREED, n + 1, every_rank=False)

    def close(self) -> None:
        self.slots.close()
        self.counters.close()
