"""The engine's guard on the parameters' storage ([Note: tracked storage] in
../_tracked.py): a parameter that moved to other memory (model.to(...),
p.data = ...) is followed where the all-gather copies into it, and refused
where the optimizer's buffers are the parameter's memory (contiguous
buffers) or where its shape changed."""
from __future__ import annotations

from .._groups import param_names
from .. import _addresses
from .._tracked import moved_indices

__all__ = ["StorageGuard"]


class StorageGuard:
    """The addresses and shapes of the engine's parameters when a layout was
    built (track), compared at every step (check): one C-level pass over the
    parameters when nothing moved."""

    def __init__(self, owner: str):
        self.owner = owner
        self.ptrs = _addresses.addresses([])
        self.shapes: list = []

    def track(self, params: list) -> None:
        self.ptrs = _addresses.addresses(params)
        self.shapes = [p.shape for p in params]

    def check(self, params: list, param_groups: list, *, contiguous_param_buffer: bool,
              contiguous_grad_buffer: bool) -> None:
        """Refuse a move the engine cannot follow (naming the first moved
        parameter in param_groups order), else follow the new addresses."""
        moved = moved_indices(params, self.ptrs)
        if not moved:
            return
        names = param_names(param_groups)
        order = {pid: i for i, pid in enumerate(names)}
        for k in sorted(moved, key=lambda k: order[id(params[k])]):  # the first in param_groups order is named
            p = params[k]
            where = f"{names[id(p)]} (shape {tuple(self.shapes[k])})"
            if p.shape != self.shapes[k]:
                raise ValueError(f"{where} changed shape to {tuple(p.shape)} since the optimizer was built "
                                 "(p.data = ... with another shape): the bucket layout and the optimizer state have "
                                 "the old one. Build a new optimizer")
            if contiguous_param_buffer or contiguous_grad_buffer:
                option = "contiguous_param_buffer" if contiguous_param_buffer else "contiguous_grad_buffer"
                made = "it a view of its parameter buffer" if contiguous_param_buffer \
                    else "its gradient a view of its gradient buffer"
                raise RuntimeError(
                    f"{where} no longer lives in the optimizer's memory: its storage was replaced (model.to(...), "
                    f"p.data = ..., a swap_tensors conversion) after {self.owner}({option}=True) made {made}, "
                    "so the optimizer would no longer reach the model. Convert the model before building the optimizer")
        self.ptrs = _addresses.addresses(params)
