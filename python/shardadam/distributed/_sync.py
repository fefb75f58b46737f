"""Bucketed gradient and parameter synchronisation for DistributedFusedAdam.

Gradients: as backward produces each parameter's gradient (a post-accumulate
hook), its fragments are copied into flat bucket buffers of grad_sync_dtype
and the parameter's ``.grad`` is released. A bucket whose fragments are all in
is reduce-scattered at once, asynchronously, while backward goes on. Buckets
start strictly in bucket order, so every rank issues the same collectives in
the same order even when its gradients arrive in another order or some never
arrive (those count as zeros when step() flushes the rest). A second gradient
for a parameter in one iteration (a backward per micro-batch without
no_sync()) starts a new round: the rest of the current round is flushed, and
the new round's reduced shards are added to the first's.

Parameters: each bucket's updated shards are all-gathered into a temporary
full bucket and copied into the parameters.

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
    """t (param's shape) flattened in param's memory order, on param's device
    (a copy only if their layouts or devices differ)."""
    if t.stride() != param.stride() or t.device != param.device:
        t = torch.empty_like(param, dtype=t.dtype).copy_(t)
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
    """One iteration's gradient synchronisation into ``shards`` ([buckets, shard])."""

    def __init__(self, params: list, layout, shards: torch.Tensor, group, pipeline_size: int):
        self.params = params
        self.shards = shards
        self.group = group
        self.bucket_size = layout.bucket_size(0)
        self.frags_of_param = [[] for _ in params]
        self.frag_count = [0] * len(layout.buckets)
        for f in layout.fragments:
            self.frags_of_param[f.param].append(f)
            self.frag_count[f.bucket] += 1
        self.pipeline = _Pipeline(pipeline_size)
        self.reset()

    def reset(self) -> None:
        """Forget this iteration (after step(), or zero_grad() without a step)."""
        self.pipeline.drain()
        self.round = 0
        self._new_round()

    def _new_round(self) -> None:
        self.buffers = [None] * len(self.frag_count)
        self.missing = list(self.frag_count)
        self.packed = [False] * len(self.params)
        self.next_bucket = 0

    def pack(self, k: int, grad: torch.Tensor) -> None:
        """Copy parameter k's gradient into its buckets and start every bucket
        that is now complete, in bucket order."""
        if self.packed[k]:  # another backward pass in the same iteration
            self._flush_round()
            self.round += 1
            self._new_round()
        param = self.params[k]
        check_tensor("a parameter's gradient", grad, param.device, kernels.FLOATS)
        flat = flat_like(grad, param)
        for f in self.frags_of_param[k]:
            self._buffer(f.bucket)[f.bucket_start:f.bucket_end].copy_(
                flat[f.param_start:f.param_end])
            self.missing[f.bucket] -= 1
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

    def _flush_round(self) -> None:
        while self.next_bucket < len(self.missing):
            self._start(self.next_bucket)

    def _buffer(self, b: int) -> torch.Tensor:
        if self.buffers[b] is None:
            # Zeros: alignment padding and absent gradients add nothing.
            self.buffers[b] = torch.zeros(self.bucket_size, dtype=self.shards.dtype, device=self.shards.device)
        return self.buffers[b]

    def _start(self, b: int) -> None:
        buffer = self._buffer(b)
        self.buffers[b] = None
        self.next_bucket = b + 1
        if self.round == 0:
            work = _reduce_scatter(self.shards[b], buffer, group=self.group, async_op=True)
            self.pipeline.push(work, buffer)
            return
        # Later rounds: reduce into a scratch shard, then add (after the wait,
        # in the caller's stream order, after the earlier rounds' results).
        scratch = torch.empty_like(self.shards[b])
        work = _reduce_scatter(scratch, buffer, group=self.group, async_op=True)
        self.pipeline.push(work, (buffer, scratch), lambda held, b=b: self.shards[b].add_(held[1]))


def param_sync(params: list, fragments_by_bucket: list, param_shards: torch.Tensor, group,
               pipeline_size: int) -> None:
    """All-gather every bucket's updated shards (``param_shards`` [buckets,
    shard], this rank's part) and copy the values into the parameters."""
    shard = param_shards.shape[1]
    world = dist.get_world_size(group)
    pipeline = _Pipeline(pipeline_size)
    for b in range(param_shards.shape[0]):
        full = torch.empty(shard * world, dtype=param_shards.dtype, device=param_shards.device)
        work = _all_gather(full, param_shards[b], group=group, async_op=True)

        def copy_out(full, frags=fragments_by_bucket[b]):
            for f in frags:
                memory_flat(params[f.param].data)[f.param_start:f.param_end].copy_(
                    full[f.bucket_start:f.bucket_end])

        pipeline.push(work, full, copy_out)
    pipeline.drain()
