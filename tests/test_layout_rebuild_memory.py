"""The first step rebuilds DistributedFusedAdam's layout in backward's order
(_adopt_backward_order). The old contiguous buffers hold the parameters and
the first gradients, so each is needed until its contents have moved; after
that nothing may keep it alive, or the rebuild's peak grows by a whole buffer
(4 bytes per fp32 parameter: the largest model that trains shrinks)."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import shardadam
from shardadam.distributed import optimizer as optimizer_module


class ReverseRegistered(nn.Module):
    """Registered in the opposite order of use, so that backward's order is
    not the layout's first guess (the parameters reversed): the first step
    rebuilds."""

    def __init__(self):
        super().__init__()
        self.second = nn.Linear(16, 16)
        self.first = nn.Linear(16, 16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_each_old_buffer_is_let_go_before_the_next_new_one_is_allocated(one_rank, monkeypatch):
    model = ReverseRegistered()
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-3, overlap_grad_sync=True,
                                         contiguous_param_buffer=True, contiguous_grad_buffer=True)
    guess = [id(p) for p in opt.params]
    # The storages, not the tensor objects: views (the parameters' data) keep a storage alive.
    old = {"parameter buffer": StorageWeakRef(opt.param_buffer.single.untyped_storage()),
           "gradient buffer": StorageWeakRef(opt.grad_buffer.single.untyped_storage())}
    alive_at_allocation = []
    allocate = optimizer_module.BucketRows.allocate

    def watched(*args, **kwargs):
        alive_at_allocation.append(sorted(name for name, ref in old.items() if not ref.expired()))
        return allocate(*args, **kwargs)

    monkeypatch.setattr(optimizer_module.BucketRows, "allocate", watched)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    assert [id(p) for p in opt.params] != guess, "the first step rebuilt the layout"
    assert alive_at_allocation[:2] == [["gradient buffer", "parameter buffer"], ["gradient buffer"]], (
        "the new parameter buffer is allocated while both old buffers hold data; the new gradient buffer "
        "only once the parameters have moved out of theirs")
    assert all(ref.expired() for ref in old.values())
