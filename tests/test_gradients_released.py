"""No optimizer holds a gradient past its step: after step() and
zero_grad(set_to_none=True) the last step's gradients are freed, as torch.optim
frees them ([Note: borrowed read lists] in _plan.py). A gradient kept alive is
one more gradient per parameter at the next backward's peak (+4 bytes per fp32
parameter). Storage weak references see a gradient kept alive through a view
too. The address checks that the plan's release must not weaken are tested
here as well: new gradients at the old addresses but of another size or dtype
are refused or followed, never read as the old ones."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef

import shardadam
from shardadam._addresses import pointers


def _model(device: str, dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device=device, dtype=dtype)


def _iterate(model, opt, device, dtype, steps: int = 3, scaler=None) -> list:
    """A few iterations; the storage weak references of the last step's gradients."""
    refs = []
    for _ in range(steps):
        loss = model(torch.randn(4, 16, device=device, dtype=dtype)).float().square().mean()
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        refs = [StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None]
        assert refs
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return refs


def _assert_released(refs) -> None:
    gc.collect()
    alive = sum(not r.expired() for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} gradients of the last step are still alive after zero_grad"


FUSED_CASES = {
    "adam fp32": (shardadam.FusedAdam, torch.float32, {}),
    "adam amsgrad": (shardadam.FusedAdam, torch.float32, dict(amsgrad=True)),
    "adam bf16 masters": (shardadam.FusedAdam, torch.bfloat16, dict(master_weights=True)),
    "adam bf16 remainders": (shardadam.FusedAdam, torch.bfloat16, dict(store_param_remainders=True)),
    "adam bf16 stochastic rounding": (shardadam.FusedAdam, torch.bfloat16, dict(bf16_stochastic_round=True)),
    "adam fp16 scaled states": (shardadam.FusedAdam, torch.float32,
                                dict(exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
    "adam fp8 exp_avg": (shardadam.FusedAdam, torch.float32, dict(exp_avg_dtype=torch.uint8)),
    "adam 8-bit": (shardadam.FusedAdam, torch.float32,
                   dict(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
    "adam bf16 sr + 8-bit": (shardadam.FusedAdam, torch.bfloat16,
                             dict(bf16_stochastic_round=True, exp_avg_dtype=shardadam.BLOCKWISE8,
                                  exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
    "adam skip nonfinite": (shardadam.FusedAdam, torch.float32, dict(skip_nonfinite_grads=True)),
    "lion fp32": (shardadam.FusedLion, torch.float32, {}),
    "lion 8-bit": (shardadam.FusedLion, torch.float32, dict(exp_avg_dtype=shardadam.BLOCKWISE8)),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_optimizers_let_go_of_the_gradients(case, device):
    cls, dtype, kwargs = FUSED_CASES[case]
    model = _model(device, dtype)
    opt = cls(model.parameters(), lr=1e-3, **kwargs)
    _assert_released(_iterate(model, opt, device, dtype))


def test_fused_adam_lets_go_when_some_parameters_have_no_gradient(device):
    model = _model(device)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3)
    _iterate(model, opt, device, torch.float32, steps=1)
    refs = []
    for _ in range(2):  # only the last layer gets a gradient: the step's one-off plan
        model[2](torch.randn(4, 32, device=device)).square().mean().backward()
        refs = [StorageWeakRef(p.grad.untyped_storage()) for p in model[2].parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_released(refs)


def test_fused_adam_lets_go_when_the_model_zeroes_the_gradients(device):
    """model.zero_grad() (Hugging Face's Trainer) never calls the optimizer's."""
    model = _model(device)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3)
    refs = []
    for _ in range(3):
        model(torch.randn(4, 16, device=device)).square().mean().backward()
        refs = [StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters()]
        opt.step()
        model.zero_grad(set_to_none=True)
    _assert_released(refs)


@pytest.mark.cuda
def test_fused_adam_capturable_with_grad_scaler_lets_go():
    model = _model("cuda")
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3, capturable=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 8)
    _assert_released(_iterate(model, opt, "cuda", torch.float32, scaler=scaler))


@pytest.mark.cuda
def test_fused_adam_host_state_lets_go():
    model = _model("cuda")
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3, state_device="cpu")
    _assert_released(_iterate(model, opt, "cuda", torch.float32))


def test_flat_grads_hold_only_the_optimizers_own_buffer(device):
    """With flat_grads the gradients are views of the optimizer's buffer (it
    keeps them, as apex's contiguous_grad_buffer); a gradient assigned by hand
    in their place is refused, and not kept either."""
    model = _model(device)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-3, flat_grads=True)
    _iterate(model, opt, device, torch.float32)
    own = [b.flat_grads for b in opt._buckets]
    assert all(p.grad is not None and p.grad.untyped_storage().data_ptr() in
               {f.untyped_storage().data_ptr() for f in own} for p in model.parameters())
    p0 = next(model.parameters())
    stranger = torch.zeros_like(p0)
    ref = StorageWeakRef(stranger.untyped_storage())
    p0.grad = stranger
    del stranger
    with pytest.raises(RuntimeError, match="flat_grads"):
        opt.step()
    p0.grad = None
    _assert_released([ref])


DISTRIBUTED_CASES = {
    "fp32 overlapped": dict(),
    "fp32 not overlapped": dict(overlap_grad_sync=False),
    "contiguous buffers, param overlap": dict(contiguous_param_buffer=True, contiguous_grad_buffer=True,
                                             overlap_param_sync=True),
    "bf16 stochastic rounding + 8-bit": dict(bf16_stochastic_round=True, exp_avg_dtype=shardadam.BLOCKWISE8,
                                             exp_avg_sq_dtype=shardadam.BLOCKWISE8),
    "fp8 exp_avg": dict(exp_avg_dtype=torch.uint8),
    "host state": dict(state_device="cpu"),
}


@pytest.mark.parametrize("case", list(DISTRIBUTED_CASES))
@pytest.mark.parametrize("optimizer", [shardadam.DistributedFusedAdam, shardadam.DistributedFusedLion])
def test_distributed_optimizers_let_go_of_the_gradients(case, optimizer, one_rank):
    kwargs = dict(DISTRIBUTED_CASES[case])
    if optimizer is shardadam.DistributedFusedLion:
        kwargs.pop("exp_avg_sq_dtype", None)
    dtype = torch.bfloat16 if kwargs.get("bf16_stochastic_round") else torch.float32
    model = _model("cpu", dtype)
    # Backward hands each gradient over in the optimizer's hook: a hook
    # registered before the optimizer's sees every gradient autograd made.
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    opt = optimizer(model.parameters(), lr=1e-3, bucket_cap_mb=1e-3, **kwargs)
    own = set()
    for _ in range(3):
        seen.clear()
        model(torch.randn(4, 16, dtype=dtype)).float().square().mean().backward()
        if opt.grad_buffer is not None:
            own = {opt.grad_buffer.single.untyped_storage().data_ptr()}
        # contiguous_grad_buffer: later gradients are views of the optimizer's own buffer (as in apex).
        refs = [StorageWeakRef(g.untyped_storage()) for g in seen if g.untyped_storage().data_ptr() not in own]
        assert len(seen) == len(list(model.parameters()))
        seen.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert refs or kwargs.get("contiguous_grad_buffer")
    _assert_released(refs)


@pytest.mark.parametrize("overlap_grad_sync", [True, False], ids=["first step", "every step"])
def test_distributed_step_releases_each_gradient_once_staged(overlap_grad_sync, one_rank):
    """A step that reduces the gradients itself (the first iteration, before
    backward's order is known, or without overlap_grad_sync) lets go of each
    one as it is copied into its bucket, as backward's hand-over does: with
    separate buffers, all gradients alive until the last bucket was one
    transient of pipeline buckets on top of every gradient."""
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=1e-3,
                                         overlap_grad_sync=overlap_grad_sync)
    params = list(model.parameters())
    transport = opt._grad_sync.transport
    alive_at_reduce = []
    reduce = transport.reduce

    def counting_reduce(b, out, absent):
        gc.collect()
        alive_at_reduce.append(sum(not r.expired() for r in refs))
        return reduce(b, out, absent)

    transport.reduce = counting_reduce
    model(torch.randn(4, 16)).square().mean().backward()
    # The first backward leaves its gradients with the optimizer: [Note: the first backward's gradients in host memory]
    assert all(p.grad is None for p in params) == overlap_grad_sync
    grads = [opt._probe.held[id(p)] if overlap_grad_sync else p.grad for p in params]
    refs = [StorageWeakRef(g.untyped_storage()) for g in grads]
    del grads
    opt.step()
    assert len(alive_at_reduce) >= 4, "the test needs several buckets"
    assert alive_at_reduce[0] < len(params) and alive_at_reduce[-1] <= 2, alive_at_reduce
    assert all(p.grad is None for p in params)
    _assert_released(refs)


# ---------------------------------------------------------------- the checks the release must keep

def _stepped_once(device):
    """A FusedAdam and torch's Adam one step in, on the same parameter and
    gradient; the gradient (the caller keeps its memory) and the address the
    plan's table holds for it."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, device=device))
    ref = nn.Parameter(p.detach().clone())
    opt = shardadam.FusedAdam([p], lr=1e-2)
    ref_opt = torch.optim.Adam([ref], lr=1e-2)
    g = torch.randn(64, device=device)
    p.grad, ref.grad = g, g.clone()
    opt.step()
    ref_opt.step()
    assert pointers(opt._buckets[0]._grad_ptrs)[0] == g.data_ptr()
    return p, ref, opt, ref_opt, g


def test_new_gradient_of_another_dtype_at_the_old_address_is_followed(device):
    """After the release, the tensor at the address the table holds may be a
    new one: here a bf16 gradient in the old fp32 gradient's memory (the
    plan no longer keeps that memory, so it may hold anything). It is not read
    as the old one: the step takes a new table and equals torch's on the
    same values."""
    p, ref, opt, ref_opt, g = _stepped_once(device)
    half = g.view(torch.bfloat16)[:64]  # the old address, 64 bf16 values
    half.copy_(torch.randn(64, device=device).to(torch.bfloat16))
    p.grad = torch.empty_like(p)
    p.grad.data = half
    assert p.grad.data_ptr() == pointers(opt._buckets[0]._grad_ptrs)[0]
    ref.grad = half.float()
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)


def test_new_gradient_of_another_size_at_the_old_address_is_refused(device):
    """The same memory seen as 128 bf16 values: the parameter has 64, so the
    step refuses it, naming the parameter, and changes nothing."""
    p, ref, opt, ref_opt, g = _stepped_once(device)
    before = p.detach().clone()
    p.grad = torch.empty_like(p)
    p.grad.data = g.view(torch.bfloat16)
    assert p.grad.data_ptr() == pointers(opt._buckets[0]._grad_ptrs)[0]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*128 elements"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_released_plan_refuses_to_launch(device):
    params = [torch.randn(8, device=device)]
    grads = [torch.randn(8, device=device)]
    plan = shardadam.kernels.AdamPlan(params, grads, [torch.zeros(8, device=device)], [torch.zeros(8, device=device)])
    plan.release_read_list(1)
    assert plan.lists["grads"] == []
    with pytest.raises(RuntimeError, match="released"):
        shardadam.kernels.adam(plan, lr=1e-3, step=1)
    plan.refresh_read_list(1, grads)
    shardadam.kernels.adam(plan, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="written"):
        plan.release_read_list(0)
