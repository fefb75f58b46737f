"""The engine's gradient scale: averaging, AMP (unscaling, inf/NaN skips,
[Note: GradScaler protocols] in _amp.py) and clipping, all folded into the
one gradient scale the kernel applies; the reduced gradients are never
rescaled in memory. ShardedOptimizer (optimizer.py) inherits these methods.

Named points of step(): _scaler_inv_scale() while validating (before
anything is written), then _gradient_scale(), _skips() and _clip_into() once
the gradients are reduced."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import kernels
from . import _amp
from ._iteration import Grads
from ._peer_timeout import naming_phase

__all__ = ["GradScaling", "clip_factor"]

_log = logging.getLogger("shardadam")


def clip_factor(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor for gradients of this
    (unscaled) norm: min(1, max_norm / (norm + 1e-6)), on the norm's device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class GradScaling:
    """Mixed into ShardedOptimizer: its reduced gradient shards, iteration and groups are theirs."""

    # torch.amp.GradScaler hands itself to step(grad_scaler=...): the
    # gradients live in this optimizer's shards, out of the scaler's reach.
    _step_supports_amp_scaling = True

    def _averaging_factor(self) -> float:
        return 1.0 / self.world_size if self.average_grad_sync else 1.0

    def _scaler_inv_scale(self, grad_scaler) -> torch.Tensor | None:
        """step()'s check of the scaler's stage: 1 / its loss scale when the
        gradients are still scaled, None when unscale_grads() unscaled them
        (or without a scaler)."""
        return _amp.check_stage(grad_scaler, self, self.iteration.inv_scale is not None, self.device)

    def _gradient_scale(self, grad_scaler, inv_loss_scale) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel's gradient scale (averaging and unscaling) and, with a
        scaler or skip_nonfinite_grads, the found-inf flag of every rank
        (reported to the scaler; counted on the device when capturable)."""
        grad_scale = torch.full((), self._averaging_factor(), dtype=torch.float32, device=self.device)
        if self.iteration.inv_scale is not None:
            grad_scale *= self.iteration.inv_scale
        found_inf = None
        if grad_scaler is not None:
            if inv_loss_scale is not None:
                grad_scale *= inv_loss_scale
            self._grad_scaler = grad_scaler
            found_inf = self._nonfinite_on_any_rank()
            _amp.report(grad_scaler, self, found_inf, self.device)
        elif self.skip_nonfinite_grads:
            found_inf = self._nonfinite_on_any_rank()
        if self.skip_nonfinite_grads and self.capturable:
            self.skipped_steps += (found_inf != 0).to(torch.int64).reshape(())
        return grad_scale, found_inf

    def _skips(self, found_inf: torch.Tensor | None) -> bool:
        """Whether this (non-capturable) step is skipped for inf/NaN: the
        host's step counters must know (counted and logged with
        skip_nonfinite_grads)."""
        if found_inf is None or self.capturable or not found_inf.item():
            return False
        if self.skip_nonfinite_grads:
            self.skipped_steps += 1
            _log.warning("%s: step skipped on every rank: the reduced gradients hold inf or NaN (%d steps "
                         "skipped so far)", type(self).__name__, self.skipped_steps)
        return True

    def _clip_into(self, grad_scale: torch.Tensor) -> None:
        """clip_grad_norm(), deferred to here: on the unscaled norm."""
        if self.iteration.clip is None:
            return
        max_norm, scaled_norm = self.iteration.clip
        unscaled = scaled_norm * (grad_scale * (self.world_size if self.average_grad_sync else 1.0))
        grad_scale *= clip_factor(max_norm, unscaled)

    def _nonfinite_on_any_rank(self) -> torch.Tensor:
        """1.0 on the device when the reduced gradient shard of any rank holds
        inf/NaN, else 0.0: one all-reduce, no host sync."""
        found = self._nonfinite_here()
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.dist_group)
        return found

    def _nonfinite_here(self) -> torch.Tensor:
        """1.0 (float32 [1], on the device) when this rank's reduced gradient
        shard holds inf/NaN, else 0.0."""
        return kernels.l2_norm(self._shard_norm_plan()).nonfinite

    def _fold_inv_scale(self, inv_scale: torch.Tensor) -> None:
        """Synchronise this iteration's gradients and have the next step
        unscale them by inv_scale (a float32 0-d tensor on the device); its
        callers have checked that none was folded yet."""
        if self.iteration.grads is not Grads.REDUCED:
            self.grad_sync()
        self.iteration.inv_scale = inv_scale

    @naming_phase("unscale_grads()")
    def unscale_grads(self, *args, inv_scale=None, grad_scaler=None) -> dict:
        """apex's deferred unscale: divide this iteration's gradients by the
        loss scale inside the next step (gradients are not rewritten):
        inv_scale (a number or a 0-d/1-element tensor; also the first
        positional argument, GradScaler._unscale_grads_'s order), or 1 /
        grad_scaler's current scale. Synchronises the gradients and returns
        {device: found_inf} (1.0 where any rank's reduced gradients hold
        inf/NaN); with grad_scaler, as scaler.unscale_(optimizer) would, the
        scaler records it and moves to its unscaled stage, so that
        clip_grad_norm() and then scaler.step(optimizer) / scaler.update() follow."""
        self._refuse_with_host_step_in_backward("unscale_grads()")
        inv_scale = _amp.requested_inv_scale(args, inv_scale, grad_scaler, self, self.iteration.inv_scale is not None,
                                             self.device)
        return _amp.fold_and_report(self, inv_scale, grad_scaler, self.device)

    @torch.no_grad()
    @naming_phase("grad_norm()")
    def grad_norm(self, parameters=None, norm_type: float = 2.0, *, grad_scaler=None) -> torch.Tensor:
        """The L2 norm of the synchronised (averaged, if average_grad_sync)
        gradient of every parameter, or of `parameters`, as a 0-d tensor;
        synchronises the gradients now if step() has not yet. Under AMP the
        norm is unscaled by the GradScaler passed here or, before, to step():
        without grad_scaler, the first iteration's norm is still scaled (the
        optimizer has not met the scaler yet)."""
        self._meet_scaler(grad_scaler)
        return self._unscaled(self._scaled_grad_norm(parameters, norm_type))

    @naming_phase("clip_grad_norm()")
    def clip_grad_norm(self, max_norm: float, parameters=None, norm_type: float = 2.0, *,
                       grad_scaler=None) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most max_norm (as
        torch.nn.utils.clip_grad_norm_), inside the next step without rewriting
        gradients; under GradScaler the norm is compared unscaled, in step().
        Returns the norm before clipping, unscaled as grad_norm()'s (pass
        grad_scaler for an unscaled norm in the first iteration too)."""
        if parameters is not None:
            raise NotImplementedError("clip_grad_norm of a subset of the parameters is not supported: the step "
                                      "applies one gradient scale to every parameter; call it without "
                                      "`parameters` (grad_norm(parameters) gives a subset's norm)")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._refuse_with_host_step_in_backward("clipping")
        self._meet_scaler(grad_scaler)
        scaled = self._scaled_grad_norm(None, norm_type)
        self.iteration.clip = (float(max_norm), scaled)  # unscaled in step()
        return self._unscaled(scaled)

    def _meet_scaler(self, grad_scaler) -> None:
        self._grad_scaler = _amp.met(grad_scaler, self._grad_scaler)

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        return _amp.unscaled_norm(norm, self.iteration.inv_scale, self._grad_scaler, self.device)

    def _scaled_grad_norm(self, parameters, norm_type: float) -> torch.Tensor:
        """The norm of the gradients as they are (loss-scaled under AMP)."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (the L2 norm), got {norm_type}")
        if self.iteration.grads is not Grads.REDUCED:
            self.grad_sync()
        local = kernels.l2_norm(self._norm_plan_for(parameters)).total
        sum_sq = local * local
        dist.all_reduce(sum_sq, group=self.dist_group)  # redundant replicas hold the same shards
        norm = sum_sq.sqrt()
        return norm / self.world_size if self.average_grad_sync else norm

    def _norm_plan_for(self, parameters) -> kernels.NormPlan:
        """The shard pieces whose norm is wanted; plans are built once per set."""
        if parameters is None:
            return self._shard_norm_plan()
        index = {id(p): k for k, p in enumerate(self.params)}
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        chosen = {index.get(id(p)) for p in params if p.requires_grad}
        if None in chosen:
            raise ValueError("grad_norm: `parameters` holds a tensor that is not a trainable parameter of this "
                             "optimizer")
        key = frozenset(chosen)
        if key not in self._subset_norm_plans:
            pieces = [self.grad_shards[f.bucket, f.shard_start:f.shard_end]
                      for f in self._shard_fragments if f.param in key]
            self._subset_norm_plans[key] = kernels.NormPlan(pieces, check_addresses=False)  # own buffers
        return self._subset_norm_plans[key]

    def _shard_norm_plan(self) -> kernels.NormPlan:
        """The whole reduced gradient shard: its padding holds zeros, so its
        norm and non-finite flag are the shard's."""
        if self._norm_plan is None:
            self._norm_plan = kernels.NormPlan([t.reshape(-1) for t in self.grad_shards.blocks],
                                               check_addresses=False)  # own buffers
        return self._norm_plan
