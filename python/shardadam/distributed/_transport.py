"""[Note: transports] How buckets travel between ranks: the reduce-scatter of the gradients and
the all-gather of the updated parameters, each a transport chosen once per
layout (choose_reduce_scatter, choose_all_gather) and driven bucket by bucket
by GradSync and ParamSync (_sync.py), which decide only when.

torch.distributed runs its collectives on its own stream (NCCL) or threads
(gloo). Between GPUs of one host, the copy engines can carry both directions
instead of NCCL's kernels, which would take SMs from the backward and
forward they overlap (_peer.py, _peer_reduce.py, _peer_gather.py). Every
transport's work has a wait() that orders the caller's current stream after
the transfer without blocking the host on CUDA.
"""
from __future__ import annotations

import abc
import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from ._flat import FlatGrads, memory_flat
from ._grad_buckets import GradBufferRows, PackedGradBuckets, gaps
from ._peer_timeout import naming_collective

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class InFlight(NamedTuple):
    """A transfer started: its work, what it reads or writes (kept alive
    until it is done), what to run once it is, and what it is (the
    transport and bucket, named when the wait times out: [Note: a peer that
    never comes] in _peer_timeout.py)."""

    work: Any
    holds: Any = None
    then: Callable[[], None] | None = None
    what: str = "collective"

    def complete(self) -> None:
        with naming_collective(self.what):
            self.work.wait()
        if self.then is not None:
            self.then()


class ReduceScatter(abc.ABC):
    """Gradients staged as they arrive, and each bucket's sum over the ranks
    reduce-scattered into this rank's shard of it.

    rounds: whether a parameter may bring a second gradient in one iteration
    (GradSync then starts a new round, staged afresh)."""

    name: str
    rounds = True

    def new_round(self) -> None:
        """Forget what was staged (a new round, or a new iteration)."""

    @abc.abstractmethod
    def stage(self, k: int, grad: torch.Tensor) -> None:
        """Parameter k's gradient arrived: keep it for its buckets."""

    @abc.abstractmethod
    def reduce(self, b: int, out: torch.Tensor, absent: list) -> InFlight:
        """Start out [shard] = the sum over ranks of their piece of bucket b.
        absent: bucket b's fragments whose gradients never came (zeros)."""

    def close(self) -> None:
        """After the last wait (a layout rebuild): let go of the peers."""


class AllGather(abc.ABC):
    """Each bucket's updated shards, gathered from every rank into the parameters.

    temporary_buckets: whether each bucket in flight holds a full bucket of its
    own (ParamSync may bound how many are alive at once)."""

    name: str
    temporary_buckets = False

    def begin(self) -> None:
        """Before an iteration's first bucket (after this rank's step)."""

    @abc.abstractmethod
    def gather(self, b: int) -> InFlight:
        """Start the all-gather of bucket b; once complete, its parameters hold the new values."""

    def close(self) -> None:
        """After the last wait (a layout rebuild): let go of the peers."""


def _backend(group) -> str:
    return str(dist.get_backend(group))


class BucketReduceScatter(ReduceScatter):
    """A reduce-scatter of whole buckets, staged by ``buckets`` (packed, or
    the contiguous gradient buffer's rows: _grad_buckets.py)."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.rounds = buckets.rounds

    def new_round(self) -> None:
        self.buckets.new_round()

    def stage(self, k: int, grad: torch.Tensor) -> None:
        self.buckets.stage(k, grad)

    def reduce(self, b: int, out: torch.Tensor, absent: list) -> InFlight:
        bucket = self.buckets.take(b, absent)
        return InFlight(self._reduce(out, bucket, b), bucket, what=f"{self.name} of bucket {b}")

    @abc.abstractmethod
    def _reduce(self, out: torch.Tensor, bucket: torch.Tensor, b: int):
        """The work of out = the sum over ranks of their piece of bucket (bucket b)."""


class CollectiveReduceScatter(BucketReduceScatter):
    """torch.distributed's reduce-scatter over group (NCCL's kernels, gloo's threads)."""

    def __init__(self, buckets, group):
        super().__init__(buckets)
        self.group = group

    @property
    def name(self) -> str:
        return f"{_backend(self.group)} reduce-scatter"

    def _reduce(self, out: torch.Tensor, bucket: torch.Tensor, b: int):
        return _reduce_scatter(out, bucket, group=self.group, async_op=True)


class CopyEngineReduceScatter(BucketReduceScatter):
    """Each piece of a bucket written into the rank that sums it, on the copy
    engines (PeerGradReduce.reduce_scatter)."""

    name = "copy-engine reduce-scatter"

    def __init__(self, buckets, peer):
        super().__init__(buckets)
        self.peer = peer

    def _reduce(self, out: torch.Tensor, bucket: torch.Tensor, b: int):
        return self.peer.reduce_scatter(out, bucket, bucket_index=b)

    def close(self) -> None:
        self.peer.close()


class CopyEngineReduceScatterFromGradients(ReduceScatter):
    """The copy-engine reduce-scatter with no bucket packed: the gradients
    are held until their buckets start, and each piece goes straight from
    the gradient to the rank that sums it, which adds its own parts where
    they lie (PeerGradReduce.reduce_scatter_parts). No copies run on the
    caller's stream, where backward's kernels would wait for them."""

    name = "copy-engine reduce-scatter from gradients"

    def __init__(self, params: list, layout, rows, peer):
        shards = rows.single  # the copy engines take one sync class: one tensor
        self.params = params
        self.peer = peer
        self.flat = FlatGrads(params, shards.device)
        self.dtype, self.device = shards.dtype, shards.device
        self.frags_of_bucket = layout.fragments_by_bucket
        # Per bucket: what goes to each peer, as (param, rank, bytes into that
        # rank's piece, bytes into the flat gradient, bytes); this rank's own
        # parts, as (param, start in the shard, start and end in the flat
        # gradient); and the positions of this rank's piece that no fragment
        # covers (zeroed after the sum).
        size = shards.element_size()
        self.peer_sends = [[] for _ in self.frags_of_bucket]
        self.own_parts = [[] for _ in self.frags_of_bucket]
        for r in range(peer.world):
            for f in layout.shard_fragments(r):
                if r == peer.rank:
                    self.own_parts[f.bucket].append((f.param, f.shard_start, f.param_start, f.param_end))
                else:
                    self.peer_sends[f.bucket].append((f.param, r, f.shard_start * size, f.param_start * size,
                                                      f.numel * size))
        self.own_gaps = [gaps([(start, start + end - begin) for _, start, begin, end in parts],
                              shards.shape[1], shards.device) for parts in self.own_parts]
        frags_of_param = [[] for _ in params]
        for f in layout.fragments:
            frags_of_param[f.param].append(f)
        self.last_bucket = [max(f.bucket for f in frags) if frags else -1 for frags in frags_of_param]
        self.new_round()

    def new_round(self) -> None:
        self.sources = [None] * len(self.params)  # flat gradients, held until their last bucket starts

    def stage(self, k: int, grad: torch.Tensor) -> None:
        self.sources[k] = self.flat(k, grad).to(self.dtype)  # no copy when the dtypes agree

    def reduce(self, b: int, out: torch.Tensor, absent: list) -> InFlight:
        sources = self._take(b)
        sends = [(r, at, sources[k].data_ptr() + offset, size) for k, r, at, offset, size in self.peer_sends[b]]
        own = [(start, sources[k][begin:end]) for k, start, begin, end in self.own_parts[b]]
        return InFlight(self.peer.reduce_scatter_parts(out, sends, own, self.own_gaps[b], bucket_index=b), sources,
                        what=f"{self.name} of bucket {b}")

    def close(self) -> None:
        self.peer.close()

    def _take(self, b: int) -> dict:
        """Bucket b's flat gradients by parameter (zeros for those that never
        came: a source still None), each let go here once its last bucket
        starts: the in-flight record holds them until the reduce-scatter
        that reads them is done."""
        sources = {}
        for f in self.frags_of_bucket[b]:
            k = f.param
            if self.sources[k] is None:
                self.sources[k] = torch.zeros(self.params[k].numel(), dtype=self.dtype, device=self.device)
            sources[k] = self.sources[k]
            if self.last_bucket[k] == b:
                self.sources[k] = None
        return sources


class CollectiveAllGather(AllGather):
    """torch.distributed's all-gather over group: in place when the
    parameters live in one contiguous buffer [buckets, bucket] (row b holds
    bucket b's parameters, and the shards are a slice of it), else through a
    temporary full bucket copied into the parameters once it has landed."""

    def __init__(self, params: list, layout, shards, buffer, group):
        self.params = params
        self.shards = shards
        self.buffer = buffer
        self.group = group
        self.bucket_size = layout.bucket_size(0)
        self.fragments_by_bucket = layout.fragments_by_bucket
        self.temporary_buckets = buffer is None

    @property
    def name(self) -> str:
        return f"{_backend(self.group)} all-gather"

    def gather(self, b: int) -> InFlight:
        shard = self.shards[b]
        full = self.buffer[b] if self.buffer is not None else torch.empty(
            self.bucket_size, dtype=shard.dtype, device=shard.device)
        work = _all_gather(full, shard, group=self.group, async_op=True)
        return InFlight(work, full, functools.partial(self._copy_out, b, full) if self.temporary_buckets else None,
                        f"{self.name} of bucket {b}")

    def _copy_out(self, b: int, full: torch.Tensor) -> None:
        for f in self.fragments_by_bucket[b]:
            memory_flat(self.params[f.param].data)[f.param_start:f.param_end].copy_(
                full[f.bucket_start:f.bucket_end])


class CopyEngineAllGather(AllGather):
    """This rank's shard of each bucket written into every peer's contiguous
    parameter buffer, on the copy engines (PeerParamGather)."""

    name = "copy-engine all-gather"

    def __init__(self, peer):
        self.peer = peer

    def begin(self) -> None:
        self.peer.begin()

    def gather(self, b: int) -> InFlight:
        return InFlight(self.peer.bucket(b), what=f"{self.name} of bucket {b}")

    def close(self) -> None:
        self.peer.close()


def choose_reduce_scatter(params: list, layout, shards, group, peer=None, buffer=None,
                          views: list | None = None) -> ReduceScatter:
    """The gradient reduce-scatter into shards (BucketRows: _rows.py, as buffer).

    peer: a connected PeerGradReduce (the copy engines), or None for group's
    collective. buffer [buckets, bucket] and views (each parameter's gradient
    view into it): the contiguous gradient buffer autograd accumulates into,
    reduced in place; None: temporary buckets packed from .grad. The
    collective needs each bucket whole in one tensor; the copy engines do
    not, and without a contiguous buffer they read the gradients themselves."""
    if peer is not None and buffer is None:
        return CopyEngineReduceScatterFromGradients(params, layout, shards, peer)
    buckets = (GradBufferRows(params, layout, shards, buffer, views) if buffer is not None
               else PackedGradBuckets(params, layout, shards))
    return CollectiveReduceScatter(buckets, group) if peer is None else CopyEngineReduceScatter(buckets, peer)


def choose_all_gather(params: list, layout, shards, buffer, group, peer=None) -> AllGather:
    """The parameter all-gather from shards (BucketRows: _rows.py). peer: a
    PeerParamGather over the contiguous parameter buffer (the copy engines),
    or None for group's collective (into buffer, or through temporary
    buckets when buffer is None)."""
    if peer is not None:
        return CopyEngineAllGather(peer)
    return CollectiveAllGather(params, layout, shards, buffer, group)
