"""The parameter all-gather on the copy engines, between GPUs of one host.

NCCL's all-gather runs as kernels: while it overlaps the next forward it takes
SMs from the forward's matmuls. Between GPUs of one host, each rank can
instead write its updated shard of a bucket straight into every peer's
contiguous parameter buffer: the peers' buffers are mapped into this process
once (CUDA IPC), and cudaMemcpyAsync to peer memory runs on the copy engines
over NVLink, with no SMs.

Ordering, all on the GPU, through meetings: tiny NCCL all-reduces of a zero on
a side stream, which complete once every rank's side stream has reached them.
Each one orders what every rank wrote before it ahead of what any rank does
after it; PeerParamGather says which hazards its meetings close.

The gradient reduce-scatter stays on NCCL: the same scheme for it (each rank
writing its peers' pieces into receive slots, a meeting and an add per
bucket) made the 1.4B GPT's backward 15-28 ms slower on 2 x H200
(benchmarks/RESULTS.md, session 5).
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .. import _core


class PeerBuffers:
    """One tensor of every rank of a group, mapped into this process."""

    def __init__(self, tensor: torch.Tensor, group, addresses: list[int], bases: list[int]):
        """addresses[r]: where rank r's tensor starts, in this process."""
        self.tensor = tensor
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.addresses = addresses
        self.bases = bases  # what ipc_open mapped, for close()
        self.stream = torch.cuda.Stream(tensor.device)
        # Meetings carry no data: each all-reduce of a zero only synchronises.
        self.meeting = torch.zeros(1, dtype=torch.float32, device=tensor.device)

    @classmethod
    def connect(cls, tensor: torch.Tensor, group) -> PeerBuffers | None:
        """Map every rank's tensor (a collective over group: every rank passes
        its own, alike in shape). None, on every rank alike, when a rank
        cannot: one rank alone, ranks on several hosts, memory that cannot be
        shared (cudaMallocAsync or expandable segments) or GPUs that cannot
        reach each other."""
        world, rank, device = dist.get_world_size(group), dist.get_rank(group), tensor.device.index
        if world == 1:
            return None  # nothing to exchange
        try:
            exported = _core.ipc_export(device, tensor.data_ptr())
        except RuntimeError:
            exported = None
        mine = (socket.gethostname(), exported)
        everyone = [None] * world
        with torch.cuda.device(tensor.device):
            dist.all_gather_object(everyone, mine, group=group)
        bases, addresses = [], []
        usable = all(host == mine[0] and e is not None for host, e in everyone)
        if usable:
            try:
                for r, (_, (handle, offset)) in enumerate(everyone):
                    if r == rank:
                        addresses.append(tensor.data_ptr())
                    else:
                        bases.append(_core.ipc_open(device, handle))
                        addresses.append(bases[-1] + offset)
            except RuntimeError:
                usable = False
        agreed = torch.tensor([float(usable)], device=tensor.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if not agreed.item():
            for base in bases:
                _core.ipc_close(device, base)
            return None
        return cls(tensor, group, addresses, bases)

    def write(self, rank: int, byte_offset: int, src: torch.Tensor) -> None:
        """Copy src (contiguous, on this device) into rank's tensor at byte_offset, on the side stream."""
        _core.copy_async(self.tensor.device.index, self.addresses[rank] + byte_offset, src.data_ptr(),
                         src.numel() * src.element_size(), self.stream.cuda_stream)

    def meet(self) -> None:
        """A meeting on the side stream: what follows on it runs after every
        rank's side stream got here."""
        with torch.cuda.stream(self.stream):
            dist.all_reduce(self.meeting, group=self.group)

    def after_caller(self) -> None:
        """The side stream waits for what the caller's stream has queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.tensor.device))

    def done(self) -> _StreamWork:
        """What the side stream has queued so far, as a work to wait for."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return _StreamWork(event)

    def close(self) -> None:
        """Wait for this rank's writes, then unmap the peers' tensors."""
        if self.bases:
            self.stream.synchronize()
        for base in self.bases:
            _core.ipc_close(self.tensor.device.index, base)
        self.bases, self.addresses = [], []

    def __del__(self):
        # Dropped without close() (an optimizer going away), or at interpreter
        # exit, when CUDA may already be shut down and nothing is left to free.
        try:
            self.close()
        except RuntimeError:
            pass


class _StreamWork:
    """A collective's work, as torch.distributed returns it: wait() orders the
    caller's current stream after it, without blocking the host."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True


class PeerParamGather:
    """The all-gather of a contiguous parameter buffer [buckets, bucket]: this
    rank's shard of each bucket, written into the same place of every peer's.

    Meetings: one before an iteration's first bucket, which every rank enters
    after its step, so no rank still reads (forward, backward) the rows about
    to be written; one after each bucket's writes, after which every peer's
    writes into this rank's bucket have landed: a forward-pre hook waits for that."""

    def __init__(self, peers: PeerBuffers):
        self.peers = peers
        buffer = peers.tensor
        self.row_bytes = buffer.stride(0) * buffer.element_size()
        self.shard = buffer.shape[1] // peers.world
        self.own = slice(peers.rank * self.shard, (peers.rank + 1) * self.shard)

    @classmethod
    def connect(cls, buffer: torch.Tensor, group) -> PeerParamGather | None:
        peers = PeerBuffers.connect(buffer, group)
        return None if peers is None else cls(peers)

    def begin(self) -> None:
        self.peers.after_caller()
        self.peers.meet()

    def bucket(self, b: int):
        """Write bucket b's shard into every peer; a work whose wait() orders
        the caller's stream after every rank's writes of bucket b."""
        src = self.peers.tensor[b, self.own]
        offset = b * self.row_bytes + self.own.start * src.element_size()
        for r in range(self.peers.world):
            if r != self.peers.rank:
                self.peers.write(r, offset, src)
        self.peers.meet()
        return self.peers.done()

    def close(self) -> None:
        self.peers.close()
