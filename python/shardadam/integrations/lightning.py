"""PyTorch Lightning with shardadam's optimizers.

FusedAdam needs nothing: return it from ``configure_optimizers`` under any
strategy.

DistributedFusedAdam synchronises the gradients itself, so the model must not
be wrapped in DDP: ``Trainer(strategy=DistributedFusedAdamStrategy(), ...)``
with the optimizer built in ``configure_optimizers`` (the process group exists
by then). The strategy is Lightning's DDPStrategy (launch, process group,
distributed sampler, reductions, barriers) minus the DDP wrapper, plus:

- gradient accumulation (``accumulate_grad_batches``): the micro-batches
  before the last one run inside ``opt.no_sync()``;
- gradient clipping (``gradient_clip_val``, by norm): ``opt.clip_grad_norm``,
  applied inside the step (the gradients live in the optimizer's shards,
  where torch.nn.utils.clip_grad_norm_ cannot see them); clipping by value
  is refused;
- checkpoints: the optimizer state is gathered (every rank takes part, rank
  0 writes the portable state dict, which loads on any number of ranks), and
  the parameters are brought up to date before the model's state is read.

Without DDP, buffers (BatchNorm's running statistics) are not broadcast from
rank 0 at each forward: each rank keeps its own, as with
SyncBatchNorm-free data parallelism.
"""
from __future__ import annotations

import contextlib

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType

from ..distributed.optimizer import ShardedOptimizer

__all__ = ["DistributedFusedAdamStrategy"]

_NO_VALUE_CLIPPING = ("gradient_clip_algorithm='value' cannot reach DistributedFusedAdam's reduced gradients (they "
                      "live in its shards): use gradient_clip_algorithm='norm'")


def _sharded(optimizer) -> ShardedOptimizer | None:
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer._optimizer
    return optimizer if isinstance(optimizer, ShardedOptimizer) else None


class DistributedFusedAdamStrategy(DDPStrategy):
    """DDPStrategy without the DDP wrapper, for DistributedFusedAdam and
    DistributedFusedLion (see the module's docstring). Takes DDPStrategy's
    arguments; the DDP-only ones (bucket sizes, comm hooks) have no effect."""

    strategy_name = "distributed_fused_adam"

    def configure_ddp(self) -> None:
        """The model stays the LightningModule: the optimizer reduces its gradients."""

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not any(_sharded(opt) for opt in self.optimizers):
            raise ValueError("DistributedFusedAdamStrategy needs a DistributedFusedAdam (or DistributedFusedLion) "
                             "from configure_optimizers: without it nothing reduces the gradients; use "
                             "DDPStrategy for other optimizers")
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(_NO_VALUE_CLIPPING)  # before the first step, on every rank
        # [Note: clipping through the optimizer] Lightning clips in its
        # precision plugin, with torch.nn.utils.clip_grad_norm_ over the
        # parameters' .grad (which the sharded optimizer has already taken),
        # and its mixed-precision plugin refuses to clip for any optimizer
        # that unscales by itself. The sharded optimizer clips inside its
        # step, on the unscaled norm.
        precision = self.precision_plugin
        clip_gradients = precision.clip_gradients

        def clip_through_optimizer(optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM):
            opt = _sharded(optimizer)
            if opt is None:
                return clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
            if clip_val <= 0:
                return None
            if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
                raise ValueError(_NO_VALUE_CLIPPING)
            opt.clip_grad_norm(float(clip_val), grad_scaler=getattr(precision, "scaler", None))
            return None

        precision.clip_gradients = clip_through_optimizer

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: backward leaves the gradients in .grad."""
        with contextlib.ExitStack() as stack:
            for opt in filter(None, map(_sharded, self.optimizers)):
                stack.enter_context(opt.no_sync())
            yield None

    def optimizer_state(self, optimizer) -> dict | None:
        """The portable state dict on rank 0 (None elsewhere): a collective,
        as every rank dumps the checkpoint and rank 0 writes it."""
        opt = _sharded(optimizer)
        return super().optimizer_state(optimizer) if opt is None else opt.state_dict(gather_on_root=True)

    def lightning_module_state_dict(self) -> dict:
        self._param_sync()
        return super().lightning_module_state_dict()

    def teardown(self) -> None:
        self._param_sync()  # before Lightning moves the module (and the user reads it)
        super().teardown()

    def _param_sync(self) -> None:
        """Let the last all-gathers land (overlap_param_sync leaves them running after step())."""
        for opt in filter(None, map(_sharded, self.optimizers)):
            opt.param_sync()
