"""The Muon groups of DistributedFusedMuon: gradients reduced to each
matrix's owner, momentum and Newton-Schulz on the owner only, the updated
matrices all-gathered ([Note: matrix-atomic ownership] in _muon_owners.py).

An iteration, per bucket (in bucket order on every rank, so the collectives
match across ranks):

1. backward: each parameter's gradient is copied into its matrices' places
   in the bucket (its owners' slots) and ``.grad`` is let go; once every
   parameter of the bucket and of every bucket before it has been handed
   over, the bucket is reduce-scattered (overlap_grad_sync; otherwise all of
   it happens in step(), as it does for buckets whose parameters got no
   gradient: they contribute zeros, as in DistributedFusedAdam). A second
   gradient for a parameter (a backward per micro-batch without no_sync())
   starts a new round, as in DistributedFusedAdam: the rest of the current
   round is reduced and waited for, and the new round's reduced gradients
   are added to the earlier rounds';
2. step(): the owner's momentum pass, batched Newton-Schulz and update pass
   (FusedMuon's MuonLayout over its matrices only) update its matrices in
   the parameters; averaging, a GradScaler's unscaling and clipping fold
   into the momentum pass's gradient scale (the reduced gradients are never
   rescaled in memory), and a step skipped for inf/NaN writes nothing;
3. each rank copies its matrices into its slot and the slots are
   all-gathered into every rank's parameters (_muon_gather.py): waited for
   in step(), or with overlap_param_sync left running, as
   DistributedFusedAdam leaves its own: each module's forward waits for
   the buckets of its parameters (a forward-pre hook: [Note: hooks on the
   modules that own the parameters] in _hooks.py), any other read of a
   parameter on its first use ([Note: first-use guard] in _first_use.py),
   and whatever reuses a bucket's buffers for gradients waits for that
   bucket ([Note: Muon buckets between iterations] in _muon_gather.py).

With a redundant group ([Note: redundant replicas] in _shard_groups.py) the
owners are spread over the distributed group, each replica set holds the
same owners, and the reduced slots are all-reduced over the redundant group
before the step, so every replica of an owner steps identically.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .. import kernels
from .._muon_layout import Entry, MuonLayout, layout_key
from ._first_use import FirstUseGuard
from ._grad_scaling import clip_factor
from ._hooks import Hooks, register_forward_waits
from ._iteration import BACKWARD_AFTER_REDUCTION
from ._muon_gather import MatrixAllGather
from ._muon_owners import Matrix, OwnerBucket, matrix_in, matrix_of, plan_owner_buckets
from ._shard_groups import ShardGroups
from ._sync import BucketGathers
from ._transport import _all_gather, _reduce_scatter


class OwnedMuon:
    """The Muon parameters' buckets, hooks, reductions, step and momentum I/O
    on one rank of ``groups.shard``."""

    def __init__(self, params: list[torch.Tensor], group_of: list[int], groups: ShardGroups, *, cap: int,
                 overlap_grad_sync: bool, overlap_param_sync: bool, average_grad_sync: bool,
                 ns_dtype: torch.dtype, momentum_dtype: torch.dtype | None = None):
        self.params = params
        self.group_of = group_of
        self.group = groups.shard  # the owners' group: reduce-scatters and all-gathers
        self.redundant = groups.redundant
        self.world = groups.shard_size  # the owners: slots per bucket
        self.rank = groups.shard_rank
        self.world_size = groups.world_size  # the ranks whose gradients are summed
        self.average = average_grad_sync
        self.ns_dtype = ns_dtype
        self.buckets: list[OwnerBucket] = plan_owner_buckets([tuple(p.shape) for p in params],
                                                             [p.dtype for p in params], self.world, cap)
        self.bucket_of = {k: b for b, bucket in enumerate(self.buckets) for k in bucket.params}
        self.matrices_of: dict[int, list[Matrix]] = {k: [] for k in range(len(params))}  # O(1) per hand-over
        for bucket in self.buckets:
            for m in bucket.matrices:
                self.matrices_of[m.param].append(m)
        device = params[0].device
        self.full = [torch.zeros(self.world * b.slot_size, dtype=b.dtype, device=device) for b in self.buckets]
        self.shard = [torch.empty(b.slot_size, dtype=b.dtype, device=device) for b in self.buckets]
        self.momentum = [torch.zeros(b.slot_size, dtype=momentum_dtype or b.dtype, device=device)
                         for b in self.buckets]
        self.stepped = False  # torch's state has no momentum_buffer before the first step
        self.clip = None      # clip_grad_norm()'s (max_norm, loss-scaled norm) for the next step
        self._norm_plan = kernels.NormPlan(self.shard, check_addresses=False)  # own buffers
        self.no_sync = False
        self._pending = [set(b.params) for b in self.buckets]
        self._works: list = [None] * len(self.buckets)
        self._launched = 0
        self._round = 0
        self._adds: list = [None] * len(self.buckets)  # a later round's reduced shard, added once waited for
        self._reduced = False  # finish_grad_sync() ran: the step's gradients are final
        self._layout = None
        self._addresses = None
        self._entries_now: list[Entry] = []
        self.overlap_param_sync = overlap_param_sync
        self.param_gathers = BucketGathers(
            MatrixAllGather(params, self.buckets, self.full, self.shard, self.group, self.rank), params,
            [b.params for b in self.buckets])
        # DistributedFusedAdam's hooks and first-use guard, holding this object
        # weakly and removed with it ([Note: hooks die with their optimizer] in _hooks.py).
        self._hooks = Hooks()
        self._first_use = self._hooks.first_use = FirstUseGuard(self._make_current) if overlap_param_sync else None
        weakref.finalize(self, self._hooks.remove)
        me = weakref.ref(self)
        if overlap_grad_sync:
            self._hooks.grad = [p.register_post_accumulate_grad_hook(
                lambda p, k=k: (lambda o: o is not None and o.hand_over(k, p))(me())) for k, p in enumerate(params)]
        self._hooks.forward = register_forward_waits(me, params) if overlap_param_sync else None

    # ------------------------------------------------------------ gradients

    def hand_over(self, k: int, p: torch.Tensor) -> None:
        """Backward produced parameter k's gradient: into its bucket, then
        launch every bucket that is complete and next in order."""
        if self.no_sync or p.grad is None:
            return  # inside no_sync() the gradient accumulates in .grad
        if self._reduced:
            raise RuntimeError(f"DistributedFusedMuon: {BACKWARD_AFTER_REDUCTION}")
        b = self.bucket_of[k]
        if k not in self._pending[b]:  # handed over already: another backward pass
            self._new_round()
        self._stage(b, k, p.grad)
        p.grad = None
        self._pending[b].discard(k)
        while self._launched < len(self.buckets) and not self._pending[self._launched]:
            self._launch(self._launched)

    def _stage(self, b: int, k: int, grad: torch.Tensor) -> None:
        bucket, full = self.buckets[b], self.full[b]
        p = self.params[k]
        if grad.shape != p.shape:
            raise ValueError(f"the gradient of Muon parameter {k} has shape {tuple(grad.shape)}, the parameter "
                             f"{tuple(p.shape)}")
        self._free(b)
        for m in self.matrices_of[k]:
            matrix_in(full, m, m.owner * bucket.slot_size).add_(matrix_of(grad, m))

    def _launch(self, b: int) -> None:
        self._free(b)
        out = self.shard[b] if self._round == 0 else torch.empty_like(self.shard[b])
        self._works[b] = _reduce_scatter(out, self.full[b], group=self.group, async_op=True)
        self._adds[b] = out if self._round else None
        self._launched = b + 1

    def _wait(self) -> None:
        """Wait for every reduction in flight; a later round's result is
        added to the shard then."""
        for b, work in enumerate(self._works):
            if work is not None:
                work.wait()
                self._works[b] = None
            if self._adds[b] is not None:
                self.shard[b].add_(self._adds[b])
                self._adds[b] = None

    def _new_round(self) -> None:
        """Reduce the rest of this round (parameters not handed over count as
        zeros), wait for it, and start the next with empty buckets."""
        for b in range(self._launched, len(self.buckets)):
            self._launch(b)
        self._wait()
        for full in self.full:
            full.zero_()
        self._pending = [set(b.params) for b in self.buckets]
        self._launched = 0
        self._round += 1

    def finish_grad_sync(self) -> None:
        """Stage the gradients backward has not handed over (no overlap, or
        parameters without a gradient: zeros), launch every bucket left, in
        order, and wait for all; with a redundant group, all-reduce the slots
        over it. Once per iteration (the all-reduce adds up): later calls
        return at once."""
        if self._reduced:
            return
        for b in range(self._launched, len(self.buckets)):
            for k in sorted(self._pending[b]):
                g = self.params[k].grad
                if g is not None:
                    self._stage(b, k, g)
                    self.params[k].grad = None
            self._pending[b].clear()
            self._launch(b)
        self._wait()
        if self.redundant is not None:  # the replicas of each slot add their sums
            for work in [dist.all_reduce(s, group=self.redundant, async_op=True) for s in self.shard]:
                work.wait()
        self._reduced = True

    def nonfinite_here(self) -> torch.Tensor:
        """1.0 (float32 [1]) when this rank's reduced gradients hold inf/NaN,
        else 0.0; synchronises the gradients first."""
        self.finish_grad_sync()
        return kernels.l2_norm(self._norm_plan).nonfinite

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of the synchronised (averaged, if
        average_grad_sync) Muon gradients, on every rank: each owner's sum
        over its slots (the padding holds zeros), all-reduced over the
        owners ([Note: redundant replicas])."""
        self.finish_grad_sync()
        sq = sum((s.float().square().sum() for s in self.shard), torch.zeros((), device=self.shard[0].device))
        dist.all_reduce(sq, group=self.group)
        return sq / self.world_size ** 2 if self.average else sq

    # ------------------------------------------------------------ step

    def _entries(self) -> list[Entry]:
        entries = []
        for b, bucket in enumerate(self.buckets):
            for m in bucket.owned_by(self.rank):
                entries.append(Entry(self.group_of[m.param], matrix_of(self.params[m.param], m),
                                     matrix_in(self.shard[b], m), matrix_in(self.momentum[b], m), (m.rows, m.cols)))
        return entries

    def _current_layout(self, param_groups: list[dict]) -> MuonLayout | None:
        """The owner's plans, rebuilt when a parameter moved or the groups'
        Newton-Schulz settings changed."""
        addresses = [(p.data_ptr(), p.shape) for p in self.params]
        if self._layout is None or addresses != self._addresses:
            self._entries_now = self._entries()
            self._addresses = addresses
            self._layout = None
        entries = self._entries_now
        if not entries:
            return None
        key = layout_key(entries, param_groups, self.ns_dtype)
        if self._layout is None or self._layout.key != key:
            self._layout = MuonLayout(entries, param_groups, self.ns_dtype, key)
        return self._layout

    @torch.no_grad()
    def step(self, param_groups: list[dict], inv_scale: torch.Tensor | None = None) -> None:
        """Reduce, step the owned matrices, all-gather the parameters (with
        overlap_param_sync, start the all-gathers: they land where the
        parameters are first needed). inv_scale: 1 / the loss scale of
        GradScaler's scaled gradients."""
        self.land_params()
        self.finish_grad_sync()
        layout = self._current_layout(param_groups)
        if layout is not None:
            grads = {id(e.param): e.grad for e in layout.entries}
            scale = torch.full((), 1.0 / self.world_size if self.average else 1.0, device=self.shard[0].device)
            if inv_scale is not None:
                scale *= inv_scale
            if self.clip is not None:
                max_norm, scaled_norm = self.clip
                scale *= clip_factor(max_norm, scaled_norm if inv_scale is None else scaled_norm * inv_scale)
            layout.step(grads, param_groups, grad_scale=scale, found_inf=None, unscale_grads=False)
        self.stepped = True
        # The all-gathers (each bucket's full buffer whole) overwrite the
        # staged gradients, and landing zeroes them: no zeroing here.
        self._new_iteration()
        # As DistributedFusedAdam's step: a graph that saved a parameter before
        # this step refuses backward through values written after it, even
        # where the all-gather lands later.
        torch.autograd.graph.increment_version(self.params)
        self.param_gathers.start()
        if self.overlap_param_sync:
            self._first_use.arm(self.params)  # [Note: first-use guard]
        else:
            self.land_params()

    def end_iteration(self) -> None:
        """Forget this iteration's gradients and clipping: for a step
        skipped for inf/NaN (which writes nothing), and at zero_grad() (a
        reduction in flight is waited for first). Once nothing was handed
        over, a zero_grad() leaves the all-gathers in flight: the buckets'
        buffers are not touched."""
        if self._round == 0 and self._launched == 0 and \
                all(p == set(b.params) for p, b in zip(self._pending, self.buckets)):
            self.clip = None
            self._reduced = False
            return  # nothing was handed over: the buckets hold zeros, or all-gathers that zero them
        self.land_params()  # [Note: Muon buckets between iterations]
        self._wait()
        for full in self.full:
            full.zero_()
        self._new_iteration()

    def _new_iteration(self) -> None:
        self.clip = None
        self._reduced = False
        self._pending = [set(b.params) for b in self.buckets]
        self._launched = 0
        self._round = 0

    # ------------------------------------------------------------ parameters

    @property
    def params_owed(self) -> bool:
        """Whether an all-gather of the last step is still in flight (the forward hooks ask)."""
        return bool(self.param_gathers.pending)

    def _make_current(self, params: list) -> None:
        """Wait for the all-gathers of the buckets holding these parameters
        (a module's forward, their first use, or their bucket taking
        gradients); once none is left, every parameter is disarmed."""
        self.param_gathers.wait_for(params)
        if not self.param_gathers.pending:
            self.land_params()
        elif self._first_use is not None:
            self._first_use.disarm(params)

    def land_params(self) -> None:
        """Wait for every all-gather in flight (none: nothing to do): every
        parameter is current, and none is armed."""
        self.param_gathers.finish()
        if self._first_use is not None:
            self._first_use.disarm_all()

    def _free(self, b: int) -> None:
        """Bucket b's buffers are about to take gradients: its all-gather, if
        still in flight, lands first ([Note: Muon buckets between iterations])."""
        if b in self.param_gathers.pending:
            self._make_current([self.params[k] for k in self.buckets[b].params])

    # ------------------------------------------------------------ momentum I/O

    @torch.no_grad()
    def momentum_buffers(self) -> dict[int, torch.Tensor]:
        """Every Muon parameter's whole momentum (its owners' pieces
        all-gathered), by parameter index, in the parameter's dtype (torch's),
        on every rank; {} before the first step. Every rank must call it."""
        if not self.stepped:
            return {}
        out = {k: torch.empty(p.shape, dtype=p.dtype, device=p.device) for k, p in enumerate(self.params)}
        for b, bucket in enumerate(self.buckets):
            gathered = self.full[b].new_empty(self.full[b].shape, dtype=self.momentum[b].dtype)
            _all_gather(gathered, self.momentum[b], group=self.group)
            for m in bucket.matrices:
                matrix_of(out[m.param], m).copy_(matrix_in(gathered, m, m.owner * bucket.slot_size))
        return out

    @torch.no_grad()
    def load_momentum(self, buffers: dict[int, torch.Tensor]) -> None:
        """Take whole momentum buffers (checked by the caller): each rank
        keeps its matrices' pieces; no buffers: the state before a first step."""
        for b, bucket in enumerate(self.buckets):
            self.momentum[b].zero_()
            for m in bucket.owned_by(self.rank):
                if buffers:
                    matrix_in(self.momentum[b], m).copy_(matrix_of(buffers[m.param], m))
        self.stepped = bool(buffers)

    def owned_momentum(self) -> list[tuple[Matrix, torch.Tensor]]:
        """The matrices this rank owns and views of their momentum, as stored
        (in momentum_dtype): what its sharded checkpoint holds."""
        return [(m, matrix_in(self.momentum[b], m)) for b, bucket in enumerate(self.buckets)
                for m in bucket.owned_by(self.rank)]

    def owned(self) -> list[Matrix]:
        """The matrices this rank orthogonalizes."""
        return [m for bucket in self.buckets for m in bucket.owned_by(self.rank)]
