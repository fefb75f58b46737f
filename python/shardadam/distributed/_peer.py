"""What the copy-engine collectives stand on, between GPUs of one host.

NCCL's collectives run as kernels: while they overlap backward or the next
forward they take SMs from the matmuls. Between GPUs of one host, each rank
can instead write straight into its peers' memory: a peer's buffer is mapped
into this process once (CUDA IPC), and cudaMemcpyAsync to peer memory runs on
the copy engines over NVLink, with no SMs.

Ordering, all on the GPU and without kernels: every rank holds 64-bit
counters that its peers raise with stream writes (fenced: whatever the
raising stream wrote before is visible to whoever sees the new value), and
that a stream waits on with stream waits. The collectives built on these
(_peer_gather.py, _peer_reduce.py) say which hazards their counters close.

A stream wait has no timeout: every group of waits is watched (_watchdog.py),
so that a peer that dies or stalls surfaces as an error after the collective's
timeout instead of leaving this rank's streams waiting for ever.
"""
from __future__ import annotations

import functools
import socket
import time

import torch
import torch.distributed as dist

from .. import _core
from . import _watchdog

DRAIN_S = 5.0  # after a failure, close() waits this long for its stream before it leaves the mappings in place

# What failed collectives used: late writes (a release, a stalled peer) may
# still land in it, so it is never freed or reused.
_KEEP_ALIVE: list = []


class PeerBuffers:
    """One tensor of every rank of a group, mapped into this process; what
    this rank writes into them runs on ``stream``."""

    def __init__(self, tensor: torch.Tensor, group, stream: torch.cuda.Stream, addresses: list[int],
                 bases: list[int]):
        """addresses[r]: where rank r's tensor starts, in this process."""
        self.tensor = tensor
        self.group = group
        self.stream = stream
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.addresses = addresses
        self.bases = bases  # what ipc_open mapped, for close()
        self.failure: str | None = None  # set when the collective using these failed: close() waits boundedly

    @classmethod
    def connect(cls, tensor: torch.Tensor, group, stream: torch.cuda.Stream, probe=None) -> PeerBuffers | None:
        """Map every rank's tensor (a collective over group: every rank passes
        its own, alike in shape). None, on every rank alike, when a rank
        cannot: one rank alone, ranks on several hosts, memory that cannot be
        shared (cudaMallocAsync or expandable segments), GPUs that cannot
        reach each other, or probe(buffers) raising RuntimeError on a rank."""
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
        bases, addresses, buffers = [], [], None
        usable = all(host == mine[0] and e is not None for host, e in everyone)
        if usable:
            try:
                for r, (_, (handle, offset)) in enumerate(everyone):
                    if r == rank:
                        addresses.append(tensor.data_ptr())
                    else:
                        bases.append(_core.ipc_open(device, handle))
                        addresses.append(bases[-1] + offset)
                buffers = cls(tensor, group, stream, addresses, bases)
                if probe is not None:
                    probe(buffers)
            except RuntimeError:
                usable = False
        # gloo (two processes on one GPU, in the tests) agrees on a host tensor; NCCL needs a device one.
        on_host = "gloo" in str(dist.get_backend(group))
        agreed = torch.tensor([float(usable)], device="cpu" if on_host else tensor.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if not agreed.item():
            if buffers is not None:
                buffers.close()
            else:
                for base in bases:
                    _core.ipc_close(device, base)
            return None
        return buffers

    def write(self, rank: int, byte_offset: int, address: int, nbytes: int) -> None:
        """Copy nbytes from address (on this device) into rank's tensor at byte_offset, on the stream."""
        _core.copy_async(self.tensor.device.index, self.addresses[rank] + byte_offset, address, nbytes,
                         self.stream.cuda_stream)

    def close(self) -> None:
        """Wait for this rank's writes, then unmap the peers' tensors. After a
        failure the wait is bounded (DRAIN_S): a stream that still waits keeps
        the mappings for the life of the process (its copies would write
        through them)."""
        if self.bases:
            if self.failure is None:
                self.stream.synchronize()
            elif not _drained(self.stream, DRAIN_S):
                self.bases, self.addresses = [], []  # left mapped
                return
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


class PeerCounters:
    """``kinds`` 64-bit counters per peer in every rank's memory: on rank r,
    counter (kind, q) is what rank q last raised there. Counters only grow,
    so a wait for a value passes for every later one too."""

    def __init__(self, mapped: PeerBuffers):
        self.mapped = mapped
        self.rank, self.world = mapped.rank, mapped.world
        self.device = mapped.tensor.device.index
        self.stream = mapped.stream
        self.row_bytes = mapped.tensor.stride(0) * 8
        self.peers = tuple(r for r in range(self.world) if r != self.rank)
        self.everyone = tuple(range(self.world))
        # watch(stream, ranks, kind, value, where) after each group of waits
        # (the watchdog's register, bound to the collective); None: unwatched.
        self.watch = None
        self.failure: str | None = None  # the watchdog's message, once the collective failed

    @classmethod
    def connect(cls, kinds: int, device: torch.device, group, stream: torch.cuda.Stream) -> PeerCounters | None:
        """A collective over group; None where the peers cannot be mapped or
        the driver has no stream memory operations."""
        counters = torch.zeros(kinds + 1, dist.get_world_size(group), dtype=torch.int64, device=device)

        def probe(mapped: PeerBuffers) -> None:  # the last row: raise and await this rank's own counter
            trial = cls(mapped)
            trial.raise_on(trial.rank, kinds, 1)
            trial.wait_for(trial.rank, kinds, 1, stream)
            stream.synchronize()
        mapped = PeerBuffers.connect(counters, group, stream, probe)
        return None if mapped is None else cls(mapped)

    def raise_on(self, rank: int, kind: int, value: int) -> None:
        """Set counter (kind, this rank) on rank to value once the stream's earlier work is done."""
        _core.stream_write_value(self.device, self.mapped.addresses[rank] + kind * self.row_bytes + self.rank * 8,
                                 value, self.stream.cuda_stream)

    def raise_on_peers(self, kind: int, value: int, and_self: bool = False) -> None:
        for r in range(self.world):
            if r != self.rank or and_self:
                self.raise_on(r, kind, value)

    def wait_for(self, rank: int, kind: int, value: int, stream: torch.cuda.Stream, where=None) -> None:
        """stream's later work waits until rank raised counter kind here to
        value; where (the bucket, or a description) names it if it times out."""
        _core.stream_wait_value(self.device, self.mapped.addresses[self.rank] + kind * self.row_bytes + rank * 8,
                                value, stream.cuda_stream)
        if self.watch is not None:
            self.watch(stream, (rank,), kind, value, where)

    def wait_for_peers(self, kind: int, value: int, stream: torch.cuda.Stream, and_self: bool = False,
                       where=None) -> None:
        """The same for every peer (and this rank): one watched group."""
        ranks = self.everyone if and_self else self.peers
        base = self.mapped.addresses[self.rank] + kind * self.row_bytes
        for r in ranks:
            _core.stream_wait_value(self.device, base + r * 8, value, stream.cuda_stream)
        if self.watch is not None:
            self.watch(stream, ranks, kind, value, where)

    def poison(self) -> None:
        """Release every wait on this rank's counters, queued or to come:
        POISON written into each of them from side streams (the watchdog,
        after a failure, which keeps the counters alive from then on)."""
        tensor = self.mapped.tensor
        base, count = tensor.data_ptr(), tensor.numel()
        for stream in _release_streams(self.device):
            for i in range(count):
                _core.stream_write_value(self.device, base + 8 * i, _watchdog.POISON, stream)

    def close(self) -> None:
        self.mapped.close()


def connect_with_counters(tensor: torch.Tensor, group, kinds: int) -> tuple[PeerBuffers, PeerCounters] | None:
    """Every rank's tensor mapped, and ``kinds`` counters, with this rank's
    writes to both on one new stream. A collective over group; None, on every
    rank alike, where either cannot be had."""
    stream = torch.cuda.Stream(tensor.device)
    counters = PeerCounters.connect(kinds, tensor.device, group, stream)
    if counters is None:
        return None
    buffers = PeerBuffers.connect(tensor, group, stream)
    if buffers is None:
        counters.close()
        return None
    return buffers, counters


class CounterWork:
    """A collective's work, as torch.distributed returns it, that is done
    once counter ``kind`` reached ``value``: from this rank alone, or from
    every rank (this one included). wait() orders the caller's current
    stream after that, without blocking the host; it raises RuntimeError
    once the collective failed (the watchdog's message). where: the bucket."""

    def __init__(self, counters: PeerCounters, kind: int, value: int, every_rank: bool, where=None):
        self.counters, self.kind, self.value, self.every_rank = counters, kind, value, every_rank
        self.where = where

    def wait(self) -> bool:
        if self.counters.failure is not None:
            raise RuntimeError(self.counters.failure)
        stream = torch.cuda.current_stream(self.counters.mapped.tensor.device)
        if self.every_rank:
            self.counters.wait_for_peers(self.kind, self.value, stream, and_self=True, where=self.where)
        else:
            self.counters.wait_for(self.counters.rank, self.kind, self.value, stream, where=self.where)
        return True


class WatchedCollective:
    """What PeerGradReduce and PeerParamGather share: their counters' waits
    watched for ``timeout`` seconds (_watchdog.py), and the failure that a
    timeout leaves: every later call raises RuntimeError with its message."""

    collective = "copy-engine collective"  # its name in messages
    kind_names: tuple = ()  # its counters' names in messages

    def _watch(self, buffers: PeerBuffers, counters: PeerCounters, timeout: float | None) -> None:
        self.buffers_watched = buffers
        self.counters = counters
        self.rank, self.world = counters.rank, counters.world
        self.group = buffers.group
        self.timeout = _watchdog.validate_timeout(timeout)
        self.failure: str | None = None
        self.watchdog = _watchdog.get()
        counters.watch = functools.partial(self.watchdog.register, self)
        self.watchdog.attach(self)

    def check(self) -> None:
        """Raise RuntimeError if this collective failed (a bool read otherwise)."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def fail(self, message: str) -> None:
        """The watchdog's verdict (its thread): later calls raise, memory is kept."""
        if self.failure is None:
            self.failure = message
            self.counters.failure = message
            for buffers in (self.buffers_watched, self.counters.mapped):
                buffers.failure = message
                _KEEP_ALIVE.append(buffers.tensor)

    def release(self) -> None:
        """Let every wait on this rank's counters pass (the watchdog's thread, after a failure)."""
        self.counters.poison()

    def rank_name(self, r: int) -> str:
        """Rank r of the group, with its global rank where that differs (messages)."""
        try:
            g = dist.get_global_rank(self.group, r) if self.group is not None else r
        except (RuntimeError, ValueError):
            g = r
        return f"rank {r}" if g == r else f"rank {r} (global rank {g})"

    def close(self) -> None:
        """Wait for this rank's writes (boundedly after a failure), unmap, stop watching."""
        try:
            self.buffers_watched.close()
            self.counters.close()
        finally:
            self.watchdog.detach(self)


def _drained(stream: torch.cuda.Stream, seconds: float) -> bool:
    """Whether stream's work completes within seconds (polled, never blocking for ever)."""
    end = time.monotonic() + seconds
    while True:
        try:
            if stream.query():
                return True
        except RuntimeError:  # a CUDA error: the context is lost, nothing will drain
            return False
        if time.monotonic() >= end:
            return False
        time.sleep(0.01)


_RELEASE_STREAMS: dict = {}


def _release_streams(device: int) -> list[int]:
    """Streams to release counters from: every stream of torch's pools on the
    device, of every priority. A stream waiting on a counter may block the
    other streams that share its hardware queue (there are 8 by default,
    CUDA_DEVICE_MAX_CONNECTIONS): writing from all of them reaches every queue
    that is not blocked (on a blocked one the write waits, harmlessly)."""
    if device not in _RELEASE_STREAMS:
        handles = []
        for priority in range(0, -8, -1):  # torch clamps to the priorities it has
            for _ in range(32):  # each pool's size; it hands its streams out in turn
                handle = torch.cuda.Stream(device=device, priority=priority).cuda_stream
                if handle not in handles:
                    handles.append(handle)
        _RELEASE_STREAMS[device] = handles
    return _RELEASE_STREAMS[device]
