"""The engine's guard on which parameters are trainable.

[Note: the trainable set] The layout shards the parameters that required
a gradient when it was built, and only those. A change of requires_grad
afterwards cannot be followed without a new layout: a parameter frozen
later would go on taking steps with zero gradients (momentum and weight
decay move it, where torch.optim leaves it alone), and one unfrozen
later has no shard, so its gradients would be ignored. step() refuses
both before anything is written: one C-level pass over the parameters.
A group added after construction (add_param_group) would have no shards
either, and a later step failed on its missing step counter:
add_param_group refuses it, adding nothing.
"""
from __future__ import annotations

from .._groups import param_names
from .._tracked import REQUIRES_GRAD

__all__ = ["TrainableSetGuard"]


class TrainableSetGuard:
    """Remembers requires_grad of every parameter of the groups when a layout
    is built (track) and refuses any change since (check)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.grouped: list | None = None  # every parameter of every group, in param_groups order
        self.trainable: list[bool] = []

    def track(self, param_groups: list) -> None:
        self.grouped = [p for g in param_groups for p in g["params"]]
        self.trainable = list(map(REQUIRES_GRAD, self.grouped))

    def refuse_new_group(self) -> None:
        """add_param_group once the layout is built."""
        if self.grouped is not None:
            raise ValueError(f"{self.owner}.add_param_group: the optimizer shards the parameters it was built "
                             f"with, so a group added now would never be trained. Build a new {self.owner} over "
                             "every group (FusedAdam, which keeps whole tensors, takes groups added later)")

    def check(self, param_groups: list) -> None:
        now = list(map(REQUIRES_GRAD, self.grouped))
        if now == self.trainable:
            return
        p = next(p for p, was, trainable in zip(self.grouped, self.trainable, now) if was != trainable)
        if p.requires_grad:
            what = ("was frozen (requires_grad=False) when the optimizer was built and requires a gradient now: it "
                    "has no shard, so its gradients would be ignored")
        else:
            what = ("was frozen (requires_grad=False) after the optimizer was built: its shard would go on taking "
                    "steps with zero gradients (momentum and weight decay would move it)")
        raise RuntimeError(f"{param_names(param_groups)[id(p)]} {what}. Set requires_grad before building "
                           f"{self.owner}, or build a new one after changing it")
