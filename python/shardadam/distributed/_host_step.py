"""The engine's host-step path ([Note: host shards] and [Note: host step in
backward] in _host_shards.py): what the state in host memory changes in an
iteration of ShardedOptimizer (optimizer.py), which inherits these methods.

Named points: step() validates with _check_host_step() and launches with
_step_on_host(); the first hand-over of an iteration calls _arm_host_step();
every call that needs the whole state first calls _refuse_mid_host_step(),
and every call that needs every gradient first _refuse_with_host_step_in_backward()."""
from __future__ import annotations

import torch

from .._groups import check_step_groups
from . import _host_shards

__all__ = ["HostStep"]


class HostStep:
    """Mixed into ShardedOptimizer: its host shards (_host), plan, rule and iteration are theirs."""

    def _refuse_with_host_step_in_backward(self, what: str) -> None:
        if self.host_step_in_backward:
            raise RuntimeError(
                f"{type(self).__name__}(host_step_in_backward=True) steps each bucket during backward, before "
                f"{what} could know every gradient: build the optimizer with host_step_in_backward=False to use it")

    def _refuse_mid_host_step(self, what: str) -> None:
        """[Note: host step in backward]: between a backward that began
        stepping the host state and step(), the state is half stepped."""
        if self.iteration.host_step:
            raise RuntimeError(
                f"{type(self).__name__}.{what} between backward and step() with host_step_in_backward=True: the "
                "host is stepping this iteration's buckets as backward reduces them, so the state is part old, "
                "part new. Call step() first")

    def _check_host_step(self, grad_scaler) -> None:
        """step()'s refusals: what needs every gradient before a bucket steps,
        and a second reduction of a bucket in the first iteration."""
        if grad_scaler is not None:
            self._refuse_with_host_step_in_backward("a GradScaler")
        if self._probe.active and self._probe.repeated and self.host_step_in_backward:
            raise RuntimeError(_host_shards.SECOND_REDUCTION)

    def _arm_host_step(self) -> None:
        """The iteration's first hand-over ([Note: host step in backward]):
        from now on each bucket is stepped on the host as soon as its
        gradients are down, with the hyperparameters and step count that
        step() would use. Not in an iteration whose masters are not all
        taken from the parameters yet (step() takes them first)."""
        if self._host is None or not all(self._initialized):
            self.iteration.host_step = False
            return
        check_step_groups(self.param_groups, self.rule)  # [Note: validate, then mutate]: before any bucket steps
        self._land_param_sync()  # the copies up overwrite the rows the last all-gathers send
        # Values, not the groups' objects: a tensor lr changed in place later is
        # neither half applied by the worker nor missed by step()'s comparison.
        # Read into host memory here, in this stream's order: the worker's
        # thread would read a GPU tensor on a stream of its own.
        read = [{k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                 for k, v in g.items() if k != "params"} for g in self.param_groups]
        hyper = self.rule.hyper([dict(g, step=g["step"] + 1) for g in read])
        grad_scale = torch.full((), self._averaging_factor(), dtype=torch.float32)
        self._host.arm(self.plan, lambda plan: self.rule.launch(plan, hyper, grad_scale=grad_scale, found_inf=None,
                                                                rounding_seed=self.rounding_seed))
        self.iteration.host_step = hyper

    def _step_on_host(self, hyper: dict, grad_scale: torch.Tensor) -> str | None:
        """step()'s launch when the state is in host memory: finish a step
        armed in backward, or step every bucket now. None when the state is
        on the device (nothing done), else the hyperparameters that moved
        since a step in backward read them ("" if none)."""
        if self.iteration.host_step:  # [Note: host step in backward]: stepped already
            self._host.finish_armed()
            return _host_shards.moved_hyperparameters(self.iteration.host_step, hyper)
        if self._host is None:
            return None
        host_scale = grad_scale.cpu()  # [Note: host shards]: the gradient scale comes down as a number
        self._host.step(self.plan, lambda plan: self.rule.launch(
            plan, hyper, grad_scale=host_scale, found_inf=None, rounding_seed=self.rounding_seed))
        return ""

    def _refuse_moved_hyperparameters(self, moved: str | None) -> None:
        """After a completed step in backward whose hyperparameters changed after backward read them."""
        if moved:
            raise RuntimeError(
                f"{type(self).__name__}(host_step_in_backward=True) stepped this iteration with the "
                f"hyperparameters it read when backward began ({moved}): they changed after that, and take effect "
                "from the next iteration. Set them before backward (as LR schedulers stepped after "
                "optimizer.step() do), or build the optimizer with host_step_in_backward=False")
