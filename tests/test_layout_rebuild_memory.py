"""The first step rebuilds DistributedFusedAdam's layout in backward's order
(_adopt_backward_order). The old contiguous buffers hold the parameters and
the first gradients, so each is needed until its contents have moved; after
that nothing may keep it alive, or the rebuild's peak grows by a whole buffer
(4 bytes per fp32 parameter: the largest model that trains shrinks)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import shardadam
from shardadam.distributed import _layout_build as optimizer_module


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


class ReverseRegisteredStack(nn.Module):
    """Several layers registered in the opposite order of use (the first step rebuilds)."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.relu(layer(x))
        return x


@pytest.mark.cuda
def test_first_step_rebuild_on_the_gpu_allocates_at_most_a_bucket_more():
    """[Note: gradients through host memory at a rebuild]: with 8-bit states
    (smaller than either buffer) the rebuild held the old gradient buffer
    while the new one was filled, a whole buffer over the steady memory; the
    first step's peak may now exceed it by at most the buckets in flight."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        torch.manual_seed(0)
        model = ReverseRegisteredStack(1024, 8).cuda()
        bucket_mb = 1.0
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=bucket_mb,
                                             contiguous_param_buffer=True, contiguous_grad_buffer=True,
                                             exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)
        guess = [id(p) for p in opt.params]
        x = torch.randn(8, 1024, device="cuda")
        model(x).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        assert [id(p) for p in opt.params] != guess, "the first step rebuilt the layout"
        buffer_bytes = sum(p.numel() for p in model.parameters()) * 4
        transient = torch.cuda.max_memory_allocated() - before
        in_flight = opt.pipeline_size * int(bucket_mb * 2 ** 20) * 2  # a gathered and a reduced bucket each
        assert transient <= in_flight, (f"the first step took {transient} bytes over its start "
                                        f"(a buffer is {buffer_bytes})")
        # The gradients that waited in host memory are the ones the step used: the new buffer holds them.
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()



# ---------------------------------------------------------------- separate buffers: the first backward's gradients

def test_first_backward_leaves_its_gradients_with_the_optimizer(one_rank):
    """[Note: the first backward's gradients in host memory]: with separate
    buffers each synchronised gradient of the first backward goes to the
    optimizer (.grad None, as after a later hand-over); a second backward adds
    to what it holds, and the first step equals torch's AdamW on the sum."""
    model = ReverseRegistered()
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-3,
                                         overlap_grad_sync=True)
    xs = [torch.randn(4, 16) for _ in range(2)]
    for x in xs:
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
    opt.step()
    summed = [torch.zeros_like(p) for p in reference]
    for x in xs:
        for s, g in zip(summed, torch.autograd.grad(torch.func.functional_call(
                model, dict(zip([n for n, _ in model.named_parameters()], reference)), (x,)).square().mean(),
                reference)):
            s += g
    for p, g in zip(reference, summed):
        p.grad = g
    torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1).step()
    for p, ref in zip(model.parameters(), reference):
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)


def test_a_gradient_set_after_the_first_backward_is_refused(one_rank):
    """As after a later hand-over ([Note: gradients set after the hand-over]):
    the step would not see it, so it is refused by name before anything is
    written; zero_grad() forgets what the first backward left."""
    model = ReverseRegistered()
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, overlap_grad_sync=True)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 16)).square().mean().backward()
    model.first.weight.grad = torch.ones_like(model.first.weight)
    with pytest.raises(RuntimeError, match=r"\['params'\]\[2\]: its gradient was set after backward handed it over.*"
                       r"set p\.grad back to None"):  # first.weight, registered third
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    assert not opt._probe.held
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    assert not all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.cuda
def test_first_iteration_with_separate_buffers_peaks_as_the_later_ones():
    """Left on the device, the first backward's gradients were all alive when
    the first step allocated the state: that iteration peaked a whole set of
    gradients above the later ones (0.94 GiB for GPT-1.4B in fp32). In host
    memory, its peak may exceed theirs by at most the buckets in flight."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        model = ReverseRegisteredStack(1024, 8).cuda()
        bucket_mb = 1.0
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=bucket_mb)
        x = torch.randn(8, 1024, device="cuda")
        peaks = []
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        gradient_bytes = sum(p.numel() for p in model.parameters()) * 4
        in_flight = opt.pipeline_size * int(bucket_mb * 2 ** 20) * 2
        assert peaks[0] <= max(peaks[1:]) + in_flight, (
            f"first iteration {peaks[0]} bytes against {max(peaks[1:])} later (the gradients are {gradient_bytes})")
    finally:
        dist.destroy_process_group()
