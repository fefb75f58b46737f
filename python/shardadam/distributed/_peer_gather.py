"""The parameter all-gather on the copy engines (distributed/_peer.py).

Each rank writes its updated shard of every bucket straight into the same
place of every peer's contiguous parameter buffer. Two counters order it:

- READY, once per iteration: a rank raises it on its peers after its step,
  and so after its forward and backward read the rows its peers are about to
  overwrite; a rank writes into a peer only once that peer is ready;
- LANDED, once per bucket, raised on every rank (this one too) after this
  rank's writes of the bucket: a forward-pre hook waits until every rank
  raised it, so the peers' rows have landed and this rank's own shard has been
  read out (the next step may overwrite it).

Each group of waits is watched (_watchdog.py): a peer that raises neither
within ``timeout`` seconds fails the all-gather with a message naming the
bucket (or the step it waited for), the peer and the counter; every later
call raises it.
"""
from __future__ import annotations

import torch

from . import _watchdog
from ._peer import CounterWork, PeerBuffers, PeerCounters, WatchedCollective, connect_with_counters

READY, LANDED = 0, 1


class PeerParamGather(WatchedCollective):
    """The all-gather of a contiguous parameter buffer [buckets, bucket]:
    this rank's shard of each bucket, written into every peer's."""

    collective = "copy-engine all-gather"
    kind_names = ("READY", "LANDED")

    def __init__(self, buffers: PeerBuffers, counters: PeerCounters, timeout: float | None = None):
        self.buffers = buffers
        buffer = buffers.tensor
        self.row_bytes = buffer.stride(0) * buffer.element_size()
        self.shard = buffer.shape[1] // buffers.world
        self.own = slice(buffers.rank * self.shard, (buffers.rank + 1) * self.shard)
        self.iterations = 0
        self.buckets_written = 0
        self._watch(buffers, counters, timeout)

    @classmethod
    def connect(cls, buffer: torch.Tensor, group, timeout: float | None = None) -> PeerParamGather | None:
        """A collective over group; None (on every rank) where the copy engines
        cannot be used. timeout: seconds a wait on a peer may take before the
        all-gather fails (None: _watchdog.DEFAULT_TIMEOUT_S; ValueError unless
        finite and > 0, before anything is exchanged)."""
        timeout = _watchdog.validate_timeout(timeout)
        connected = connect_with_counters(buffer, group, kinds=2)
        return None if connected is None else cls(*connected, timeout)

    def begin(self) -> None:
        """After this rank's step (queued on the caller's stream): wait until every peer is ready too."""
        if self.failure is not None:  # a peer timed out
            raise RuntimeError(self.failure)
        self.iterations += 1
        stream = self.buffers.stream
        stream.wait_stream(torch.cuda.current_stream(self.buffers.tensor.device))
        self.counters.raise_on_peers(READY, self.iterations)
        self.counters.wait_for_peers(READY, self.iterations, stream,
                                     where=f"iteration {self.iterations}, before its first bucket")

    def bucket(self, b: int) -> CounterWork:
        """Write bucket b's shard into every peer; a work whose wait() orders
        the caller's stream after every rank's writes of bucket b."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        src = self.buffers.tensor[b, self.own]
        offset = b * self.row_bytes + self.own.start * src.element_size()
        for r in range(self.buffers.world):
            if r != self.buffers.rank:
                self.buffers.write(r, offset, src.data_ptr(), src.numel() * src.element_size())
        self.buckets_written += 1
        self.counters.raise_on_peers(LANDED, self.buckets_written, and_self=True)
        return CounterWork(self.counters, LANDED, self.buckets_written, every_rank=True, where=b)
