"""When buckets are synchronised for DistributedFusedAdam; how they travel is
the transport's (_transport.py).

Gradients: as backward produces each parameter's gradient (a post-accumulate
hook), the transport stages it for its buckets and the parameter's ``.grad``
is released. A bucket whose gradients are all in is reduce-scattered at once,
asynchronously, while backward goes on. Buckets start strictly in bucket
order, so every rank issues the same collectives in the same order even when
its gradients arrive in another order or some never arrive (those count as
zeros when step() flushes the rest). A second gradient for a parameter in one
iteration (a backward per micro-batch without no_sync()) starts a new round:
the rest of the current round is flushed, and the new round's reduced shards
are added to the first's.

Parameters: each bucket's updated shards are all-gathered; with
overlap_param_sync the all-gathers run while the next forward starts, each
module waiting for the buckets of its own parameters (BucketGathers, which
DistributedFusedMuon's owned matrices travel by too).

At most ``pipeline_size`` gradient buckets are in flight: once another one
starts, the oldest are waited for until that many remain. ParamSync.start(depth)
bounds the all-gather's temporary buckets the same way.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from ._transport import AllGather, InFlight, ReduceScatter, choose_all_gather, choose_reduce_scatter


class _Pipeline:
    """Transfers in flight (InFlight records), oldest first."""

    def __init__(self, depth: int):
        self.depth = depth
        self.pending: deque = deque()

    def push(self, record: InFlight) -> None:
        self.pending.append(record)
        while len(self.pending) > self.depth:
            self.pending.popleft().complete()

    def drain(self) -> None:
        while self.pending:
            self.pending.popleft().complete()


class GradSync:
    """One iteration's gradient synchronisation into ``shards`` (BucketRows:
    _rows.py): reduce-scatter over ``group``, then, with a redundant group,
    all-reduce of the shards over it."""

    def __init__(self, params: list, layout, shards, group, pipeline_size: int, redundant_group=None,
                 buffer: torch.Tensor | None = None, views: list | None = None, peer=None, *,
                 transport: ReduceScatter | None = None, on_reduced: Callable[[int], None] | None = None):
        """buffer, views and peer choose the transport (choose_reduce_scatter
        in _transport.py); transport: one to use instead. on_reduced(b): run
        once the current stream is ordered after every change to bucket b's
        shard so far (host state: [Note: host shards] in _host_shards.py)."""
        self.params = params
        self.on_reduced = on_reduced
        self.shards = shards
        self.redundant_group = redundant_group
        self.transport = transport or choose_reduce_scatter(params, layout, shards, group, peer, buffer, views)
        self.frags_of_bucket = layout.fragments_by_bucket
        self.frag_count = [len(frags) for frags in self.frags_of_bucket]
        self.buckets_of_param = [[] for _ in params]
        for f in layout.fragments:
            self.buckets_of_param[f.param].append(f.bucket)
        self.pipeline = _Pipeline(pipeline_size)
        self.reset()

    def reset(self) -> None:
        """Forget this iteration (after step(), or zero_grad() without a step)."""
        self.pipeline.drain()
        self.round = 0
        self._new_round()

    def _new_round(self) -> None:
        self.transport.new_round()
        self.missing = list(self.frag_count)
        self.arrived = [False] * len(self.params)
        self.next_bucket = 0

    def pack(self, k: int, grad: torch.Tensor) -> None:
        """Stage parameter k's gradient for its buckets and start every bucket
        that is now complete, in bucket order."""
        if self.arrived[k]:  # another backward pass in the same iteration
            if not self.transport.rounds:
                raise RuntimeError(
                    "DistributedFusedAdam(contiguous_grad_buffer=True): a second gradient for a parameter in one "
                    "iteration; accumulate micro-batches inside optimizer.no_sync()")
            self._flush_round()
            self.round += 1
            self._new_round()
        self.transport.stage(k, grad)
        for b in self.buckets_of_param[k]:
            self.missing[b] -= 1
        self.arrived[k] = True
        while self.next_bucket < len(self.missing) and self.missing[self.next_bucket] == 0:
            self._start(self.next_bucket)

    def finish(self, release_grads: bool = False) -> None:
        """Stage the gradients backward did not hand over (hooks off, or set
        by hand), start the remaining buckets (absent gradients count as
        zeros) and wait for every reduce-scatter. release_grads: set each
        staged parameter's .grad to None at once, as backward's hand-over
        does, so that a step reducing every gradient (the first, or one
        without overlap_grad_sync) holds no more memory than a step after an
        overlapped backward: the staged copy and the shards hold what the
        reduction needs, and one gradient fewer is alive with each bucket."""
        for k, p in enumerate(self.params):
            if not self.arrived[k] and p.grad is not None:
                self.pack(k, p.grad)
                if release_grads:
                    p.grad = None
        self._flush_round()
        self.pipeline.drain()
        if self.redundant_group is not None:  # replicas of a shard add their sums
            for t in self.shards.blocks:
                dist.all_reduce(t, group=self.redundant_group)
            if self.on_reduced is not None:
                for b in range(len(self.shards)):
                    self.on_reduced(b)

    def close(self) -> None:
        """Before the buffers go (a layout rebuild): wait for what is in flight, let go of the peers."""
        self.reset()
        self.transport.close()

    def _flush_round(self) -> None:
        while self.next_bucket < len(self.missing):
            self._start(self.next_bucket)

    def _start(self, b: int) -> None:
        absent = [f for f in self.frags_of_bucket[b] if not self.arrived[f.param]] if self.missing[b] else []
        self.next_bucket = b + 1
        # The redundant group's all-reduce changes every shard after the last round.
        reduced = self.on_reduced if self.redundant_group is None else None
        if self.round == 0:
            record = self.transport.reduce(b, self.shards[b], absent)
            self.pipeline.push(record._replace(then=reduced and functools.partial(reduced, b)))
            return
        # Later rounds: reduce into a scratch shard, then add (after the wait,
        # in the caller's stream order, after the earlier rounds' results).
        scratch = torch.empty_like(self.shards[b])
        record = self.transport.reduce(b, scratch, absent)

        def add() -> None:
            self.shards[b].add_(scratch)
            if reduced is not None:
                reduced(b)

        self.pipeline.push(record._replace(then=add))


class BucketGathers:
    """All-gathers bucket by bucket through an AllGather transport, each
    parameter waiting only for the buckets that hold it: DistributedFusedAdam's
    parameter shards (ParamSync) and DistributedFusedMuon's owned matrices
    (_muon_gather.py).

    start() launches every bucket's all-gather, first-needed first (buckets
    hold the parameters in reverse order, so forward needs the last bucket
    first); wait_for(params) waits for just the buckets holding those
    parameters (a module's forward-pre hook), finish() for all of them.
    """

    def __init__(self, transport: AllGather, params: list, params_of_bucket: list):
        """params_of_bucket: per bucket, the indices into params of the parameters it holds."""
        self.transport = transport
        self.n_buckets = len(params_of_bucket)
        self.buckets_of = {}
        for b, held in enumerate(params_of_bucket):
            for k in held:
                self.buckets_of.setdefault(id(params[k]), []).append(b)
        self.pending: dict = {}  # bucket -> InFlight

    def start(self, depth: int | None = None) -> None:
        """Launch the all-gathers; with a depth, wait so that at most that many
        temporary buckets are alive (no limit for a transport without them)."""
        self.transport.begin()
        for b in reversed(range(self.n_buckets)):
            self.pending[b] = self.transport.gather(b)
            if self.transport.temporary_buckets and depth is not None and len(self.pending) > depth:
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
        """Before the buffers go (a layout rebuild): land everything, let go of the peers."""
        self.finish()
        self.transport.close()

    def _finish_bucket(self, b: int) -> None:
        self.pending.pop(b).complete()


class ParamSync(BucketGathers):
    """The all-gather of DistributedFusedAdam's updated parameter shards, over its bucket layout."""

    def __init__(self, params: list, layout, shards, buffer, group, peer=None, *,
                 transport: AllGather | None = None):
        """shards, buffer: BucketRows (_rows.py); shards: this rank's new values. buffer and peer
        choose the transport (choose_all_gather in _transport.py); transport:
        one to use instead."""
        super().__init__(transport or choose_all_gather(params, layout, shards, buffer, group, peer), params,
                         [[f.param for f in frags] for frags in layout.fragments_by_bucket])
