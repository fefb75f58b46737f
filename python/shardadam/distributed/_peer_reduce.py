"""The gradient reduce-scatter on the copy engines (distributed/_peer.py).

NCCL's reduce-scatter overlaps backward as kernels that hold SMs for as long
as the transfer lasts, and backward's matmuls slow down around them. Here
each rank writes piece q of a bucket straight into rank q's receive slot on
the copy engines (from the gradients themselves, when the bucket was never
packed); rank q adds what it received to its own piece, or to its own parts of
the gradients where they lie, with one short kernel per part. Two counters
order it:

- ARRIVED, raised on the receiver after a sender's write of a bucket: the add
  waits until every peer's piece arrived;
- FREED, raised after the add, on every rank (this one too): a sender waits
  until the receiver has added a slot's last contents before writing into it
  again, and the caller's wait (the pipeline's) orders what reads the reduced
  shard, or reuses the bucket's memory, after this rank's copies and add.

Each group of waits is watched (_watchdog.py): a peer that raises neither
within ``timeout`` seconds fails the reduce-scatter with a message naming the
bucket, the peer and the counter; every later call raises it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _watchdog
from ._peer import CounterWork, PeerBuffers, PeerCounters, WatchedCollective, connect_with_counters

ARRIVED, FREED = 0, 1


class PeerGradReduce(WatchedCollective):
    """Reduce-scatters of buckets [world * shard] into shards [shard] (sums),
    through ``depth`` receive slots of [world - 1, shard] per rank used in turn."""

    collective = "copy-engine reduce-scatter"
    kind_names = ("ARRIVED", "FREED")

    def __init__(self, slots: PeerBuffers, counters: PeerCounters, depth: int, timeout: float | None = None):
        self.slots = slots
        self.depth = depth
        self.calls = 0
        self._watch(slots, counters, timeout)

    @classmethod
    def connect(cls, shard: int, dtype: torch.dtype, device: torch.device, group, depth: int = 2,
                timeout: float | None = None):
        """A collective over group; None (on every rank) where the copy engines
        cannot be used. timeout: seconds a wait on a peer may take before the
        reduce-scatter fails (None: _watchdog.DEFAULT_TIMEOUT_S; ValueError
        unless finite and > 0, before anything is exchanged)."""
        timeout = _watchdog.validate_timeout(timeout)
        receive = torch.empty(depth, dist.get_world_size(group) - 1, shard, dtype=dtype, device=device)
        connected = connect_with_counters(receive, group, kinds=2)
        return None if connected is None else cls(*connected, depth, timeout)

    def reduce_scatter(self, out: torch.Tensor, bucket: torch.Tensor, bucket_index: int | None = None) -> CounterWork:
        """out = the sum over ranks of their piece ``rank`` of a packed bucket;
        every rank calls this or reduce_scatter_parts for the same buckets in
        the same order. bucket_index: the bucket's number, for messages."""
        pieces = bucket.view(self.world, -1)
        size = pieces.element_size()
        sends = [(r, 0, pieces[r].data_ptr(), pieces[r].numel() * size) for r in range(self.world) if r != self.rank]
        return self._reduce(out, sends, [(0, pieces[self.rank])], bucket_index=bucket_index)

    def reduce_scatter_parts(self, out: torch.Tensor, sends: list, own: list, gaps: tuple,
                             bucket_index: int | None = None) -> CounterWork:
        """The same for a bucket that was never packed, in parts: sends
        (rank, bytes into its piece, source address, bytes) for the peers,
        own (start in out, tensor) for this rank. gaps (an index or None, where
        the tail begins): the positions of out that no own part covers."""
        return self._reduce(out, sends, own, gaps, bucket_index)

    def _reduce(self, out: torch.Tensor, sends: list, own: list, gaps: tuple | None = None,
                bucket_index: int | None = None) -> CounterWork:
        """sends written into the peers' receive slots on the copy engines;
        out = own + what the peers sent, added on the same stream."""
        if self.failure is not None:  # a peer timed out: what this would compute is garbage
            raise RuntimeError(self.failure)
        n, self.calls = self.calls, self.calls + 1
        where = bucket_index if bucket_index is not None else f"call {n + 1}"
        slot = n % self.depth
        stream, receive = self.slots.stream, self.slots.tensor
        stream.wait_stream(torch.cuda.current_stream(out.device))  # the gradients are ready
        if n >= self.depth:  # every receiver has added what this rank last wrote into this slot
            self.counters.wait_for_peers(FREED, n - self.depth + 1, stream, where=where)
        slot_bytes = receive.stride(0) * receive.element_size()
        row_bytes = receive.stride(1) * receive.element_size()
        for r, offset, address, nbytes in sends:
            row = self.rank - (self.rank > r)  # this rank's row among r's senders
            self.slots.write(r, slot * slot_bytes + row * row_bytes + offset, address, nbytes)
        self.counters.raise_on_peers(ARRIVED, n + 1)
        self.counters.wait_for_peers(ARRIVED, n + 1, stream, where=where)
        with torch.cuda.stream(stream):
            received = receive[slot]
            for start, part in own:  # read from where it lies: no copy of this rank's piece first
                end = start + part.numel()
                torch.add(part, received[0, start:end], out=out[start:end])
            for row in received[1:]:  # more than 2 ranks
                out.add_(row)
            if gaps is not None:  # a receive slot holds what an earlier bucket left where this one has padding
                between, tail = gaps
                if between is not None:
                    out.index_fill_(0, between, 0)
                if tail < out.numel():
                    out[tail:].zero_()
        self.counters.raise_on_peers(FREED, n + 1, and_self=True)
        return CounterWork(self.counters, FREED, n + 1, every_rank=False, where=where)
