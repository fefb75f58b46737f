"""FusedAdam with 16-bit params and low-precision states: fp32 masters, bf16
remainders, fp32/bf16/fp16 moments (fp16 with per-tensor scales)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_bits_equal, randn
from shardadam import FusedAdam
from test_fused_adam_helpers import (BF16, DNAME, F16, F32, assert_states_match, backward, batches, clone_model,
                                     close, copy_grads, fp32_copies, make_model, true_state)

STEPS = 10
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
ULP = {F32: 2.0 ** -23, BF16: 2.0 ** -7, F16: 2.0 ** -10}


def assert_pow2(scale: torch.Tensor, what: str) -> None:
    mant, _ = torch.frexp(scale.detach().cpu())
    assert bool((scale > 0).all()) and bool((mant == 0.5).all()), f"{what} is not a power of two: {scale}"


def bf16_ties_away(x: torch.Tensor) -> torch.Tensor:
    """The bf16 nearest to each fp32 value, ties away from zero (finite values),
    by integer ops on the bits: what a bf16 param beside its remainder holds."""
    u = x.detach().cpu().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((u + 0x8000) >> 16) & 0xFFFF
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16)
    return hi.view(torch.bfloat16).reshape(x.shape)


# ---------------------------------------------------------------- master weights

@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_master_weights_track_fp32_adamw(device, dtype):
    """16-bit model + fp32 masters == fp32 torch AdamW started from the upcast
    params and fed the same (upcast) gradients; the 16-bit param is the master
    rounded to nearest after every step. An fp32 param in the same optimizer
    has no master and matches torch too."""
    model = make_model(device, dtype)
    extra = nn.Parameter(randn(37, device=device))  # an fp32 param beside the 16-bit ones
    params = list(model.parameters())[:3] + [extra] + list(model.parameters())[3:]
    ref = fp32_copies(params)
    opt = FusedAdam(params, master_weights=True, **HYPER)
    topt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for s, (x, y) in enumerate(batches(STEPS, device, dtype), 1):
        opt.zero_grad()
        backward(model, x, y)
        extra.grad = randn(37, device=device, scale=0.1)
        grads = [p.grad.detach().clone() for p in params]
        for p, r, g in zip(params, ref, grads):
            p.grad = g
            r.grad = g.to(F32)
        opt.step()
        topt.step()
        for i, (p, r) in enumerate(zip(params, ref)):
            if p is extra:
                assert "master_param" not in opt.state[p], "an fp32 param got a master copy"
                close(p, r, f"step {s} fp32 param")
                continue
            master = opt.state[p]["master_param"]
            assert master.dtype == F32 and master.shape == p.shape
            assert_bits_equal(p, master.to(dtype), f"step {s} param[{i}] vs master rounded to nearest")
            close(master, r, f"step {s} master[{i}]")
    assert_states_match(opt, params, topt, ref)
    masters = [opt.state[p]["master_param"] for p in params if p is not extra]
    assert any(not torch.equal(m, m.to(dtype).to(F32)) for m in masters), "masters hold nothing beyond the param"


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_remainders_equal_fp32_masters_bit_for_bit(device, adam_w_mode):
    """bf16 params + int16 remainders: the master in state_dict() equals the
    fp32-master run's bit for bit given the same gradients, and the bf16 param
    is that master rounded to nearest (ties away from zero)."""
    model = make_model(device, BF16)
    other = clone_model(model)
    params, oparams = list(model.parameters()), list(other.parameters())
    opt = FusedAdam(params, store_param_remainders=True, adam_w_mode=adam_w_mode, **HYPER)
    oopt = FusedAdam(oparams, master_weights=True, master_weight_dtype=F32, adam_w_mode=adam_w_mode, **HYPER)
    for s, (x, y) in enumerate(batches(STEPS, device, BF16), 1):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(params, oparams)
        opt.step()
        oopt.step()
        sd = opt.state_dict()["state"]
        for i, (p, q) in enumerate(zip(params, oparams)):
            st = opt.state[p]
            assert "master_param" not in st and st["param_remainder"].dtype == torch.int16
            master = sd[i]["master_param"]
            assert master.dtype == F32
            assert_bits_equal(master, oopt.state[q]["master_param"], f"step {s} master[{i}]")
            assert_bits_equal(sd[i]["exp_avg"], oopt.state[q]["exp_avg"], f"step {s} exp_avg[{i}]")
            assert_bits_equal(sd[i]["exp_avg_sq"], oopt.state[q]["exp_avg_sq"], f"step {s} exp_avg_sq[{i}]")
            assert_bits_equal(p.cpu(), bf16_ties_away(master), f"step {s} bf16 param[{i}]")
    # The remainders carry what bf16 alone loses.
    last = opt.state_dict()["state"][3]["master_param"]
    assert not torch.equal(last, params[3].detach().float())


# ---------------------------------------------------------------- state dtypes

STATE_COMBOS = [(a, b) for a in (F32, BF16, F16) for b in (F32, BF16, F16) if (a, b) != (F32, F32)]


@pytest.mark.parametrize("exp_avg_dtype,exp_avg_sq_dtype", STATE_COMBOS,
                         ids=[f"m_{DNAME[a]}-v_{DNAME[b]}" for a, b in STATE_COMBOS])
def test_state_dtypes_track_fp32_states(device, exp_avg_dtype, exp_avg_sq_dtype):
    model = make_model(device)
    ref = clone_model(model)
    params, rparams = list(model.parameters()), list(ref.parameters())
    initial = [p.detach().clone() for p in params]
    opt = FusedAdam(params, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, **HYPER)
    ropt = FusedAdam(rparams, **HYPER)
    for x, y in batches(STEPS, device):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(params, rparams)
        opt.step()
        ropt.step()
    sd = opt.state_dict()["state"]
    unit = max(ULP[exp_avg_dtype], ULP[exp_avg_sq_dtype])
    for i, (p, r) in enumerate(zip(params, rparams)):
        st = opt.state[p]
        for key, dt in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
            assert st[key].dtype == dt and st[key].shape == p.shape
            if dt == F16:
                scale = st[key + "_scale"]
                assert scale.dtype == F32 and scale.dim() == 0
                assert_pow2(scale, f"{key}_scale[{i}]")
                assert scale.item() >= 2.0 ** 10, "the states are small: their scale should be large"
                amax = st[key].float().abs().max().item()
                assert 2.0 ** 14 <= amax <= 2.0 ** 15, f"stored {key}[{i}] amax {amax} not just under 2^15"
            else:
                assert key + "_scale" not in st
            true = true_state(opt, p, key)
            assert_bits_equal(sd[i][key], true, f"state_dict {key}[{i}] is not the stored value unscaled")
            want = ropt.state[r][key]
            if dt == F32:  # AdamW moments depend on the gradients only: exact
                assert_bits_equal(true, want, f"fp32 {key}[{i}]")
            else:
                close(true, want, f"{key}[{i}] ({DNAME[dt]})", rtol=2 * ULP[dt], atol_rel=2 * ULP[dt])
        moved = r.detach() - initial[i]
        close(p.detach() - initial[i], moved, f"param[{i}] update", rtol=0, atol_rel=2 * unit)
        assert moved.abs().max().item() > 1e-3


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_tiny_gradients_with_fp16_states_track_fp32(device, amsgrad):
    """Gradients of 1e-4: exp_avg_sq (~1e-11) lies below fp16's smallest
    subnormal; with per-tensor scales the fp16 states still track fp32 states
    (and so does the AMSGrad maximum)."""
    shapes = [(64, 33), (7,), (1000,)]
    params = [nn.Parameter(randn(s, device=device)) for s in shapes]
    ref = fp32_copies(params)
    initial = [p.detach().clone() for p in params]
    kw = dict(lr=1e-3, betas=(0.9, 0.99) if amsgrad else (0.9, 0.999), weight_decay=0.01, amsgrad=amsgrad)
    opt = FusedAdam(params, exp_avg_dtype=F16, exp_avg_sq_dtype=F16, **kw)
    ropt = FusedAdam(ref, **kw)
    for s in range(STEPS):
        for p, r in zip(params, ref):
            p.grad = randn(p.shape, device=device, scale=1e-4 * (0.5 ** s if amsgrad else 1.0))
            r.grad = p.grad.clone()
        opt.step()
        ropt.step()
    sd = opt.state_dict()["state"]
    tol = 2 * ULP[F16]
    for i, (p, r) in enumerate(zip(params, ref)):
        want_v = ropt.state[r]["exp_avg_sq"]
        assert want_v.max().item() < 2.0 ** -24, "exp_avg_sq is representable in plain fp16: the case tests nothing"
        assert opt.state[p]["exp_avg_sq_scale"].item() >= 2.0 ** 40
        close(true_state(opt, p, "exp_avg_sq"), want_v, f"exp_avg_sq[{i}]", rtol=tol, atol_rel=tol)
        close(true_state(opt, p, "exp_avg"), ropt.state[r]["exp_avg"], f"exp_avg[{i}]", rtol=tol, atol_rel=tol)
        if amsgrad:
            want_max = ropt.state[r]["max_exp_avg_sq"]
            close(sd[i]["max_exp_avg_sq"], want_max, f"max_exp_avg_sq[{i}]", rtol=tol, atol_rel=tol)
            assert (want_max > 1.01 * want_v).float().mean().item() > 0.5, "the AMSGrad maximum does not matter here"
        moved = r.detach() - initial[i]
        close(p.detach() - initial[i], moved, f"param[{i}] update", rtol=0, atol_rel=4 * ULP[F16])
        assert moved.abs().max().item() > 1e-3
