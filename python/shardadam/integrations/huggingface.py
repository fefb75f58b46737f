"""transformers' Trainer with shardadam's optimizers.

FusedAdam needs nothing: ``Trainer(optimizers=(FusedAdam(model.parameters()),
scheduler))``, or ``optimizer_cls_and_kwargs=(FusedAdam, {...})``.

DistributedFusedAdam synchronises the gradients itself, so the model must not
be wrapped in DDP, and a few of Trainer's steps must go through the optimizer.
``DistributedFusedAdamTrainer`` (or ``DistributedFusedAdamTrainerMixin`` in
front of another Trainer subclass) does that and nothing else; with any other
optimizer it is Trainer:

- the model is prepared by Accelerate without the DDP wrapper (autocast,
  device placement and torch.compile still apply), and the optimizer without
  Accelerate's device placement (a state_dict round trip that would gather
  the whole state on every rank);
- gradient accumulation: the micro-batches before the last one run inside
  ``opt.no_sync()``;
- gradient clipping and the logged norm: ``opt.clip_grad_norm`` and
  ``opt.grad_norm`` (the gradients live in the optimizer's shards, where
  torch.nn.utils.clip_grad_norm_ cannot see them);
- checkpoints: every rank takes part in gathering the optimizer state (a
  collective) and in bringing the parameters up to date before the model is
  saved; ``optimizer.pt`` holds the portable state dict, which
  DistributedFusedAdam loads on any number of ranks. On resume every rank
  reads it into host memory and keeps its own shard (Trainer would load the
  whole state onto every GPU; some transformers versions also cannot load it
  for processes on an indexed CPU device).
"""
from __future__ import annotations

import contextlib
import os

import torch
import transformers
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..distributed.optimizer import ShardedOptimizer

__all__ = ["DistributedFusedAdamTrainer", "DistributedFusedAdamTrainerMixin"]


class _GatheredState:
    """Stands in for the optimizer while Trainer saves it on rank 0: its
    state_dict() is the one every rank gathered beforehand."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class DistributedFusedAdamTrainerMixin:
    """Put in front of a transformers.Trainer subclass (see the module's docstring)."""

    def _sharded_optimizer(self) -> ShardedOptimizer | None:
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate wraps it
        return opt if isinstance(opt, ShardedOptimizer) else None

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        opt = self._sharded_optimizer()
        if opt is None or not training:
            return super()._wrap_model(model, training, dataloader)
        if opt.contiguous_grad_buffer:
            raise ValueError(f"{type(self).__name__} needs {type(opt).__name__}(contiguous_grad_buffer=False): "
                             "Trainer clears gradients with model.zero_grad(), which would drop the parameters' "
                             "views of the gradient buffer")
        # Prepared models and optimizers are not prepared again: Trainer's
        # accelerator.prepare then leaves the model unwrapped.
        self.optimizer = self.accelerator.prepare(self.optimizer, device_placement=[False])
        return self.accelerator.prepare_model(model, evaluation_mode=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        opt = self._sharded_optimizer()
        accumulating = opt is not None and not self.accelerator.sync_gradients
        with opt.no_sync() if accumulating else contextlib.nullcontext():
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        opt = self._sharded_optimizer()
        if opt is None:
            return super()._clip_grad_norm(model)
        return opt.clip_grad_norm(self.args.max_grad_norm, grad_scaler=self.accelerator.scaler)

    def _get_grad_norm(self, model, grad_norm=None):
        opt = self._sharded_optimizer()
        if opt is not None and grad_norm is None:
            grad_norm = opt.grad_norm(grad_scaler=self.accelerator.scaler)
        return super()._get_grad_norm(model, grad_norm)

    def save_model(self, output_dir=None, _internal_call: bool = False):
        opt = self._sharded_optimizer()
        if opt is not None:
            opt.param_sync()  # every rank: the last all-gathers may still be running
        return super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._sharded_optimizer()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        gathered = opt.state_dict(gather_on_root=True)  # a collective; None off rank 0
        optimizer, self.optimizer = self.optimizer, _GatheredState(gathered)
        try:
            super()._save_optimizer_and_scheduler(output_dir)  # writes on rank 0 (args.should_save)
        finally:
            self.optimizer = optimizer

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self._sharded_optimizer()
        saved = None if checkpoint is None else os.path.join(checkpoint, OPTIMIZER_NAME)
        if opt is None or saved is None or not os.path.isfile(saved):
            return super()._load_optimizer_and_scheduler(checkpoint)
        opt.load_state_dict(torch.load(saved, map_location="cpu", weights_only=True))
        schedule = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(schedule):
            self.lr_scheduler.load_state_dict(torch.load(schedule, map_location="cpu", weights_only=True))


class DistributedFusedAdamTrainer(DistributedFusedAdamTrainerMixin, transformers.Trainer):
    """transformers.Trainer that runs DistributedFusedAdam (and DistributedFusedLion) without DDP."""
