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

__all__ = ["GradScaling"]

_log = logging.getLogger("shardadam")


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
        if grad_scaler is None:
            return None
        unscaled = _amp.stage(grad_scaler, self) == "UNSCALED"
        if unscaled and self.iteration.inv_scale is None:
            raise RuntimeError(f"scaler.unscale_(optimizer) cannot reach {type(self).__name__}'s gradients "
                               "(they live in its buckets): call optimizer.unscale_grads(grad_scaler=scaler) "
                               "instead, or nothing (clip_grad_norm() and step() unscale by themselves)")
        if not unscaled and self.iteration.inv_scale is not None:
            raise RuntimeError("the GradScaler steps gradients that unscale_grads(inv_scale=...) already "
                               "unscaled: they would be unscaled twice; use "
                               "unscale_grads(grad_scaler=scaler), or one of the two")
        return None if unscaled else _amp.inv_scale(grad_scaler, self.device)

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
        grad_scale *= torch.clamp(max_norm / (unscaled + 1e-6), max=1.0)

    def _nonfinite_on_any_rank(self) -> torch.Tensor:
        """1.0 on the device when the reduced gradient shard of any rank holds
        inf/NaN, else 0.0: one all-reduce, no host sync."""
        found = kernels.l2_norm(self._shard_norm_plan()).nonfinite
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.dist_group)
        return found

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
        if args:
            if inv_scale is not None:
                raise TypeError("unscale_grads: inv_scale given both by position and by keyword")
            inv_scale = args[0]
        if (inv_scale is None) == (grad_scaler is None):
            raise ValueError("unscale_grads needs exactly one of inv_scale or grad_scaler")
        self._refuse_with_host_step_in_backward("unscale_grads()")
        if self.iteration.inv_scale is not None:
            raise RuntimeError("unscale_grads() was already called in this iteration (after the last step() or "
                               "zero_grad()): the gradients would be unscaled twice")
        if grad_scaler is not None:
            stage = _amp.stage(grad_scaler, self)
            if stage != "READY":
                raise RuntimeError(f"unscale_grads(grad_scaler=...): the scaler is {stage} for this optimizer "
                                   "(unscale_ or step already ran since the last update())")
            inv_scale = _amp.inv_scale(grad_scaler, self.device)
        inv_scale = torch.as_tensor(inv_scale, dtype=torch.float32, device=self.device).reshape(())
        if self.iteration.grads is not Grads.REDUCED:
            self.grad_sync()
        found_inf = self._nonfinite_on_any_rank()
        self.iteration.inv_scale = inv_scale
        if grad_scaler is not None:
            self._grad_scaler = grad_scaler
            _amp.report(grad_scaler, self, found_inf, self.device, unscaled=True)
        return {self.device: found_inf}

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
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._grad_scaler = grad_scaler

    def _unscaled(self, norm: torch.Tensor) -> torch.Tensor:
        if self.iteration.inv_scale is not None:  # unscale_grads() ran
            return norm * self.iteration.inv_scale
        # A scaler that has not scaled a loss yet has no scale: the gradients are not scaled.
        if self._grad_scaler is None or self._grad_scaler._scale is None:
            return norm
        return norm * self._grad_scaler._scale.to(self.device, torch.float32).reciprocal().reshape(())

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
