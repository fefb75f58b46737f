"""Bucketed gradient and parameter synchronisation for DistributedFusedAdam.

Gradients: as backward produces each parameter's gradient (a post-accumulate
hook), its fragments are copied into flat bucket buffers of grad_sync_dtype
and the parameter's ``.grad`` is released. A bucket whose fragments are all in
is reduce-scattered at once, asynchronously, while backward goes on. On the
copy engines no bucket is packed: the gradients are held until their bucket
starts, and each piece goes straight from the gradient to the rank that sums
it (no copies on the caller's stream, where backward's kernels would wait for
them). Buckets start strictly in bucket order, so every rank issues the same collectives in
the same order even when its gradients arrive in another order or some never
arrive (those count as zeros when step() flushes the rest). A second gradient
for a parameter in one iteration (a backward per micro-batch without
no_sync()) starts a new round: the rest of the current round is flushed, and
the new round's reduced shards are added to the first's.

Parameters: each bucket's updated shards are all-gathered, in place when the
parameters live in one contiguous buffer, else through a temporary full bucket
copied into the parameters; with overlap_param_sync the all-gathers run while
the next forward starts, each module waiting for the buckets of its own
parameters. Between GPUs of one host, both directions can run on the copy
engines instead of NCCL's kernels (distributed/_peer_reduce.py and
_peer_gather.py).

At most ``pipeline_size`` full-size bucket buffers are alive per direction:
the oldest collective is waited for before another one starts. torch.distributed
runs the collectives on its own stream (NCCL) or threads (gloo); a wait
orders the caller's current stream after the collective without blocking the host on CUDA.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from .. import kernels
from .._torch import check_tensor

# torch 2.13 renamed the flat-tensor collectives; older releases have only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in memory order (channels_last included):
    the order the layout flattens parameters, gradients and states in."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def flat_like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """t (param's shape) flattened in param's memory order, where t lies (a
    copy only if the layouts differ): a loaded host tensor stays on the host,
    so only the slices needed travel to the device."""
    if t.stride() != param.stride():
        t = torch.empty_like(param, dtype=t.dtype, device=t.device).copy_(t)
    return memory_flat(t)


class _Pipeline:
    """Collectives in flight, oldest first, each with the buffers it uses and
    what to do once it is done."""

    def __init__(self, depth: int):
        self.depth = depth
        self.pending: deque = deque()

    def push(self, work, buffers, then=None) -> None:
        """buffers: what the collective uses, kept alive until it is done;
        then(buffers) runs after the wait."""
        self.pending.append((work, buffers, then))
        while len(self.pending) > self.depth:
            self.retire_oldest()

    def retire_oldest(self) -> None:
        work, buffers, then = self.pending.popleft()
        work.wait()
        if then is not None:
            then(buffers)

    def drain(self) -> None:
        while self.pending:
            self.retire_oldest()


class GradSync:
    """One iteration's gradient synchronisation into ``shards`` ([buckets,
    shard]): reduce-scatter over ``group``, then, with a redundant group,
    all-reduce of the shards over it."""

    def __init__(self, params: list, layout, shards: torch.Tensor, group, pipeline_size: int, redundant_group=None,
                 buffer: torch.Tensor | None = None, views: list | None = None, peer=None):
        """buffer [buckets, bucket] and views (each parameter's gradient view
        into it): a contiguous gradient buffer that autograd accumulates into,
        reduce-scattered in place; None: temporary buckets packed from .grad.
        peer: a PeerGradReduce, to reduce-scatter on the copy engines instead
        of NCCL (distributed/_peer_reduce.py), straight from .grad unless
        there is a contiguous buffer."""
        self.params = params
        self.peer = peer
        self.shards = shards
        self.group = group
        self.redundant_group = redundant_group
        self.buffer = buffer
        self.views = views
        self.bucket_size = layout.bucket_size(0)
        self.frags_of_param = [[] for _ in params]
        for f in layout.fragments:
            self.frags_of_param[f.param].append(f)
        self.frags_of_bucket = layout.fragments_by_bucket
        self.frag_count = [len(frags) for frags in self.frags_of_bucket]
        self.direct = peer is not None and buffer is None
        # Temporary buckets (no contiguous buffer, not direct): what no fragment covers, zeroed per bucket.
        self.gaps = [_gaps([(f.bucket_start, f.bucket_end) for f in frags], self.bucket_size, shards.device)
                     for frags in self.frags_of_bucket] if buffer is None and not self.direct else None
        # Straight from the gradients (the copy engines, no contiguous buffer),
        # per bucket: what goes to each peer, as (param, rank, bytes into that
        # rank's piece, bytes into the flat gradient, bytes); this rank's own
        # parts, as (param, start in the shard, start and end in the flat
        # gradient); and the positions of this rank's piece that no fragment
        # covers (zeroed after the sum).
        if self.direct:
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
            self.own_gaps = [_gaps([(start, start + end - begin) for _, start, begin, end in parts],
                                   shards.shape[1], shards.device) for parts in self.own_parts]
            self.last_bucket = [max(f.bucket for f in frags) if frags else -1 for frags in self.frags_of_param]
        # pack() runs once per parameter inside backward, where its host time
        # adds to backward's: what it needs is prepared here as plain tuples.
        # A gradient laid out like its parameter (what autograd produces) is
        # flattened without checks; anything else takes the checked path.
        self.expected = [(p.dtype, p.stride(), p.is_contiguous(), p.numel()) for p in params]
        self.spans = [[(f.bucket, f.bucket_start, f.bucket_end,
                        None if f.numel == p.numel() else slice(f.param_start, f.param_end))
                       for f in frags] for p, frags in zip(params, self.frags_of_param)]
        self.pipeline = _Pipeline(pipeline_size)
        self.reset()

    def reset(self) -> None:
        """Forget this iteration (after step(), or zero_grad() without a step)."""
        self.pipeline.drain()
        self.round = 0
        self._new_round()

    def _new_round(self) -> None:
        self.buffers = [None] * len(self.frag_count)
        self.sources = [None] * len(self.params)  # direct: flat gradients held until their buckets start
        self.missing = list(self.frag_count)
        self.packed = [False] * len(self.params)
        self.next_bucket = 0

    def pack(self, k: int, grad: torch.Tensor) -> None:
        """Copy parameter k's gradient into its buckets and start every bucket
        that is now complete, in bucket order."""
        if self.packed[k]:  # another backward pass in the same iteration
            if self.buffer is not None:  # autograd already added it into a bucket being reduced
                raise RuntimeError(
                    "DistributedFusedAdam(contiguous_grad_buffer=True): a second gradient for a parameter in one "
                    "iteration; accumulate micro-batches inside optimizer.no_sync()")
            self._flush_round()
            self.round += 1
            self._new_round()
        in_place = self.views is not None and grad.data_ptr() == self.views[k].data_ptr() \
            and grad.stride() == self.views[k].stride()
        if not in_place:  # not the buffer's view (e.g. model.zero_grad() dropped it): copy
            dtype, stride, contiguous, numel = self.expected[k]
            # The element count too: ``p.grad.data = t`` can give a gradient
            # any size, and the copies read as many bytes as the layout says.
            if grad.dtype is dtype and grad.stride() == stride and grad.numel() == numel \
                    and grad.device == self.shards.device:
                flat = grad.view(-1) if contiguous else memory_flat(grad)
            else:
                check_tensor("a parameter's gradient", grad, self.shards.device, kernels.FLOATS)
                if grad.numel() != self.params[k].numel():
                    raise ValueError(f"the gradient of a parameter of shape {tuple(self.params[k].shape)} has "
                                     f"{grad.numel()} elements (shape {tuple(grad.shape)}): was it set with "
                                     "p.grad.data = ...?")
                flat = flat_like(grad, self.params[k])
            if self.direct:
                self.sources[k] = flat.to(self.shards.dtype)  # no copy when the dtypes agree
            else:
                for b, start, end, piece in self.spans[k]:
                    self._buffer(b)[start:end].copy_(flat if piece is None else flat[piece])
        for b, _, _, _ in self.spans[k]:
            self.missing[b] -= 1
        self.packed[k] = True
        while self.next_bucket < len(self.missing) and self.missing[self.next_bucket] == 0:
            self._start(self.next_bucket)

    def finish(self) -> None:
        """Pack the gradients backward did not hand over (hooks off, or set by
        hand), start the remaining buckets (absent gradients count as zeros)
        and wait for every reduce-scatter."""
        for k, p in enumerate(self.params):
            if not self.packed[k] and p.grad is not None:
                self.pack(k, p.grad)
        self._flush_round()
        self.pipeline.drain()
        if self.redundant_group is not None:  # replicas of a shard add their sums
            dist.all_reduce(self.shards, group=self.redundant_group)

    def close(self) -> None:
        """Before the buffers go (a layout rebuild): wait for what is in flight, unmap the peers."""
        self.reset()
        if self.peer is not None:
            self.peer.close()

    def _flush_round(self) -> None:
        while self.next_bucket < len(self.missing):
            self._start(self.next_bucket)

    def _buffer(self, b: int) -> torch.Tensor:
        if self.buffer is not None:
            return self.buffer[b]
        if self.buffers[b] is None:
            # Fragments are overwritten by their gradients: only the alignment
            # padding between them and the tail need zeros (writing the whole
            # bucket would add a bucket's worth of memory traffic to backward).
            buffer = torch.empty(self.bucket_size, dtype=self.shards.dtype, device=self.shards.device)
            between, tail = self.gaps[b]
            if between is not None:
                buffer.index_fill_(0, between, 0)
            if tail < self.bucket_size:
                buffer[tail:].zero_()
            self.buffers[b] = buffer
        return self.buffers[b]

    def _start(self, b: int) -> None:
        source = self._sources(b) if self.direct else self._packed(b)
        self.buffers[b] = None
        self.next_bucket = b + 1
        if self.round == 0:
            self.pipeline.push(self._reduce_scatter(self.shards[b], b, source), source)
            return
        # Later rounds: reduce into a scratch shard, then add (after the wait,
        # in the caller's stream order, after the earlier rounds' results).
        scratch = torch.empty_like(self.shards[b])
        work = self._reduce_scatter(scratch, b, source)
        self.pipeline.push(work, (source, scratch), lambda held, b=b: self.shards[b].add_(held[1]))

    def _packed(self, b: int) -> torch.Tensor:
        """Bucket b's buffer, with zeros where gradients never came."""
        buffer = self._buffer(b)
        if self.buffer is None and self.missing[b]:
            for f in self.frags_of_bucket[b]:
                if not self.packed[f.param]:
                    buffer[f.bucket_start:f.bucket_end].zero_()
        return buffer

    def _sources(self, b: int) -> dict:
        """Bucket b's flat gradients by parameter (zeros for those that never
        came), each let go once its last bucket starts: the pipeline holds
        them until the reduce-scatter that reads them is done."""
        sources = {}
        for f in self.frags_of_bucket[b]:
            k = f.param
            if self.sources[k] is None:
                self.sources[k] = torch.zeros(self.params[k].numel(), dtype=self.shards.dtype,
                                              device=self.shards.device)
            sources[k] = self.sources[k]
            if self.last_bucket[k] == b:
                self.sources[k] = None
        return sources

    def _reduce_scatter(self, out: torch.Tensor, b: int, source):
        """source: bucket b's packed buffer, or (direct) its flat gradients by parameter."""
        if self.direct:
            sends = [(r, at, source[k].data_ptr() + offset, size) for k, r, at, offset, size in self.peer_sends[b]]
            own = [(start, source[k][begin:end]) for k, start, begin, end in self.own_parts[b]]
            return self.peer.reduce_scatter_parts(out, sends, own, self.own_gaps[b], bucket_index=b)
        if self.peer is not None:
            return self.peer.reduce_scatter(out, source, bucket_index=b)
        return _reduce_scatter(out, source, group=self.group, async_op=True)


def _gaps(spans: list, size: int, device) -> tuple[torch.Tensor | None, int]:
    """What no span (start, end) of [0, size) covers: the positions between
    spans (alignment padding: a device index, or None) and where the tail begins."""
    between, end = [], 0
    for start, stop in sorted(spans):
        between.extend(range(end, start))
        end = stop
    index = torch.tensor(between, dtype=torch.int64, device=device) if between else None
    return index, end


class ParamSync:
    """The all-gather of the updated parameter shards, bucket by bucket.

    ``shards`` [buckets, shard] hold this rank's new values. With a contiguous
    parameter buffer (``buffer`` [buckets, bucket], whose row b the parameters
    of bucket b are views of, and of which ``shards`` is a slice) the all-gather
    lands in place; otherwise each bucket goes through a temporary full buffer
    that is copied into the parameters.

    start() launches every bucket's all-gather, first-needed first (buckets
    hold the parameters in reverse order, so forward needs the last bucket
    first); wait_for(params) waits for just the buckets holding those
    parameters (a module's forward-pre hook), finish() for all of them.
    """

    def __init__(self, params: list, layout, shards: torch.Tensor, buffer: torch.Tensor | None, group, peer=None):
        """peer: a PeerParamGather over buffer, to write the shards on the copy
        engines instead of NCCL's all-gather (distributed/_peer_gather.py)."""
        self.params = params
        self.peer = peer
        self.shards = shards
        self.buffer = buffer
        self.group = group
        self.bucket_size = layout.bucket_size(0)
        self.fragments_by_bucket = layout.fragments_by_bucket
        self.buckets_of = {}
        for f in layout.fragments:
            self.buckets_of.setdefault(id(params[f.param]), []).append(f.bucket)
        self.pending: dict = {}  # bucket -> (work, full buffer)

    def start(self, depth: int | None = None) -> None:
        """Launch the all-gathers; with a depth, wait so that at most that many
        temporary buffers are alive (no limit with a contiguous buffer)."""
        if self.peer is not None:
            self.peer.begin()
        for b in reversed(range(self.shards.shape[0])):
            full = self.buffer[b] if self.buffer is not None else torch.empty(
                self.bucket_size, dtype=self.shards.dtype, device=self.shards.device)
            work = self.peer.bucket(b) if self.peer is not None else _all_gather(
                full, self.shards[b], group=self.group, async_op=True)
            self.pending[b] = (work, full)
            if self.buffer is None and depth is not None and len(self.pending) > depth:
                self._finish_bucket(next(iter(self.pending)))

    def wait_for(self, params) -> None:
        for p in params:
            for b in self.buckets_of.get(id(p), ()):
                if b in self.pending:
                    self._finish_bucket(b)

    def finish(self) -> None:
        for b in list(self.pending):
            self._finish_bucket(b)

    def close(self) -> None:
        """Before the buffers go (a layout rebuild): land everything, unmap the peers."""
        self.finish()
        if self.peer is not None:
            self.peer.close()

    def _finish_bucket(self, b: int) -> None:
        work, full = self.pending.pop(b)
        work.wait()
        if self.buffer is None:
            for f in self.fragments_by_bucket[b]:
                memory_flat(self.params[f.param].data)[f.param_start:f.param_end].copy_(
                    full[f.bucket_start:f.bucket_end])
