"""1-D views of parameters and gradients in memory order: the order the
layout flattens parameters, gradients and states in."""
from __future__ import annotations

import torch

from .._torch import check_tensor
from ._options import PARAM_DTYPES


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a dense tensor in memory order (channels_last included)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def flat_like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """t (param's shape) flattened in param's memory order, where t lies (a
    copy only if the layouts differ): a loaded host tensor stays on the host,
    so only the slices needed travel to the device."""
    if t.stride() != param.stride():
        t = torch.empty_like(param, dtype=t.dtype, device=t.device).copy_(t)
    return memory_flat(t)


class FlatGrads:
    """Each parameter's gradient as a flat view in the parameter's memory
    order, checked. It runs once per parameter inside backward, where its host
    time adds to backward's: what it needs is prepared here as plain tuples,
    and a gradient laid out like its parameter (what autograd produces) is
    flattened without further checks; anything else takes the checked path."""

    def __init__(self, params: list, device: torch.device):
        self.params = params
        self.device = device
        self.expected = [(p.dtype, p.stride(), p.is_contiguous(), p.numel()) for p in params]

    def __call__(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        dtype, stride, contiguous, numel = self.expected[k]
        # The element count too: ``p.grad.data = t`` can give a gradient any
        # size, and the copies read as many bytes as the layout says.
        if grad.dtype is dtype and grad.stride() == stride and grad.numel() == numel and grad.device == self.device:
            return grad.view(-1) if contiguous else memory_flat(grad)
        check_tensor("a parameter's gradient", grad, self.device, PARAM_DTYPES)
        if grad.numel() != self.params[k].numel():
            raise ValueError(f"the gradient of a parameter of shape {tuple(self.params[k].shape)} has "
                             f"{grad.numel()} elements (shape {tuple(grad.shape)}): was it set with "
                             "p.grad.data = ...?")
        return flat_like(grad, self.params[k])
