"""Muon's element-wise passes (kernels.muon_momentum, kernels.muon_update)
against torch's own ops, the ones torch.optim.Muon runs, per group."""
from __future__ import annotations

import pytest
import torch

from shardadam import kernels

SIZES = [(64, 48), (70_000,), (3, 5)]  # more than one chunk, and odd sizes
# fp32 against torch's ops: bit for bit on the CPU (the same fused
# multiply-adds as torch's vectorised kernels); on CUDA to rounding, as
# torch's kernels fuse where nvcc contracts them.
_FP32_TOL = {"cpu": dict(rtol=0, atol=0), "cuda": dict(rtol=1e-6, atol=1e-6)}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_momentum_pass_matches_torch_lerp(device, nesterov, grad_dtype):
    grads = [torch.randn(s, device=device).to(grad_dtype) for s in SIZES]
    bufs = [torch.randn(s, device=device).to(grad_dtype) for s in SIZES]
    updates = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in SIZES]
    momenta = [0.95, 0.5, 0.0]
    expected_bufs = [b.clone() for b in bufs]
    expected_updates = []
    for b, g, mu in zip(expected_bufs, grads, momenta):
        b.lerp_(g, 1 - mu)
        expected_updates.append((g.lerp(b, mu) if nesterov else b).bfloat16())
    kernels.muon_momentum(updates, grads, bufs, momentum=momenta, nesterov=nesterov,
                          group_sizes=[1, 1, 1])
    # fp32: torch's lerp, bit for bit. bf16: the kernel's nesterov lerp reads
    # the new buffer before it is rounded to bf16, torch's after: up to half
    # a bf16 step of the buffer apart (|buf| < 8 here).
    tol = _FP32_TOL[device] if grad_dtype == torch.float32 else dict(rtol=8e-3, atol=1.6e-2)
    for b, e in zip(bufs, expected_bufs):
        torch.testing.assert_close(b, e, **tol)
    for u, e in zip(updates, expected_updates):
        torch.testing.assert_close(u, e, **tol)


def test_momentum_pass_unscales_and_skips(device):
    g = torch.randn(100, device=device) * 1024
    buf = torch.zeros(100, device=device)
    update = torch.empty(100, device=device)
    flag = torch.ones(1, device=device)
    before = (g.clone(), buf.clone())
    kernels.muon_momentum([update], [g], [buf], momentum=0.9, grad_scale=1 / 1024, found_inf=flag,
                          unscale_grads=True)
    assert torch.equal(g, before[0]) and torch.equal(buf, before[1])
    flag.zero_()
    kernels.muon_momentum([update], [g], [buf], momentum=0.9, nesterov=False, grad_scale=1 / 1024,
                          found_inf=flag, unscale_grads=True)
    torch.testing.assert_close(g, before[0] / 1024, rtol=0, atol=0)
    torch.testing.assert_close(buf, torch.zeros(100, device=device).lerp_(g, 1 - 0.9), **_FP32_TOL[device])
    torch.testing.assert_close(update, buf, rtol=0, atol=0)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_update_pass_matches_torch_mul_and_add(device, param_dtype):
    params = [torch.randn(s, device=device).to(param_dtype) for s in SIZES]
    updates = [torch.randn(s, device=device).bfloat16() for s in SIZES]
    lrs, wds, ratios = [0.02, 0.5, 1e-3], [0.1, 0.0, 2.0], [1.0, 1.7, 0.2]
    expected = [p.clone() for p in params]
    for p, u, lr, wd, r in zip(expected, updates, lrs, wds, ratios):
        p.mul_(1 - lr * wd)
        p.add_(u, alpha=-lr * r)
    kernels.muon_update(params, updates, lr=lrs, weight_decay=wds, lr_ratio=ratios, group_sizes=[1, 1, 1])
    # fp32: torch's roundings (p * decay, then a fused multiply-add; _FP32_TOL).
    # bf16: torch rounds to bf16 after the decay too; the kernel once, at the
    # end: up to one bf16 step of p * decay apart (|p| < 8 here).
    tol = _FP32_TOL[device] if param_dtype == torch.float32 else dict(rtol=8e-3, atol=3.2e-2)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, **tol)


def test_update_pass_takes_a_device_lr(device):
    p = torch.randn(10, device=device)
    u = torch.randn(10, device=device)
    expected = p * (1 - 0.5 * 0.1) - 0.5 * 2.0 * u
    kernels.muon_update([p], [u], lr=torch.tensor(0.5, device=device), weight_decay=0.1, lr_ratio=2.0)
    torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("call, match", [
    (lambda t: kernels.muon_momentum([t], [t.clone()], [t.clone()], momentum=1.0), "momentum"),
    (lambda t: kernels.muon_momentum([t], [t.clone()], [t.clone()], momentum=[0.5, 0.5]), "2 values"),
    (lambda t: kernels.muon_update([t], [t.clone()], lr=0.1, lr_ratio=-1.0), "lr_ratio"),
    (lambda t: kernels.muon_update([t], [t.clone()], lr=-0.1), "lr"),
])
def test_bad_numbers_raise_before_writing(call, match):
    t = torch.ones(4)
    with pytest.raises(ValueError, match=match):
        call(t)
    assert torch.equal(t, torch.ones(4))


def test_update_plan_refuses_states():
    t = torch.ones(4)
    with pytest.raises(TypeError):
        kernels.MuonUpdatePlan([t], [t.clone()], exp_avgs=[t.clone()])
