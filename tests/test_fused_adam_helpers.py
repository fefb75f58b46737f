"""Shared helpers for the FusedAdam tests (no tests here).

Models are small real networks (Conv2d / Linear); the gradients of a step are
computed once, from the FusedAdam model, and the same values are given to the
run it is compared with, so that only the optimizers differ.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_bits_equal, randn
from reference import AdamHyper, adam_step

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DNAME = {F32: "f32", F16: "f16", BF16: "bf16"}
# fp32 parity with torch.optim: elementwise rtol, and an absolute tolerance
# relative to the tensor's largest value. Params use 1e-7 of their magnitude
# (below one fp32 ulp at the largest value). The moments use 1e-6: torch forms
# exp_avg with lerp, whose rounding differs from b1*m + (1-b1)*g by a few ulps
# where m and g nearly cancel.
RTOL = 1e-6
PARAM_ATOL = 1e-7
STATE_ATOL = 1e-6
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def make_model(device="cpu", dtype=F32) -> nn.Sequential:
    """Conv2d -> ReLU -> Linear -> Tanh -> Linear on (N, 3, 8, 8) inputs."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 6 * 6, 16), nn.Tanh(), nn.Linear(16, 4),
    ).to(device=device, dtype=dtype)


def make_batch(device="cpu", dtype=F32, n=8, channels_last=False):
    x = randn((n, 3, 8, 8), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return x, randn((n, 4), F32, device)


def batches(count, device="cpu", dtype=F32, **kw):
    return [make_batch(device, dtype, **kw) for _ in range(count)]


def backward(model, x, y, loss_scale=1.0):
    loss = F.mse_loss(model(x).float(), y) * loss_scale
    loss.backward()
    return loss


def copy_grads(src_params, dst_params, dtype=None) -> None:
    """dst.grad = a copy of src.grad (None stays None), memory format kept."""
    for s, d in zip(src_params, dst_params):
        if s.grad is None:
            d.grad = None
        else:
            g = s.grad.detach().clone()
            d.grad = g.to(dtype) if dtype is not None else g


def fp32_copies(params):
    """fp32 nn.Parameters holding the (upcast) values of params."""
    return [nn.Parameter(p.detach().to(F32).clone(), requires_grad=p.requires_grad) for p in params]


def clone_model(model):
    return copy.deepcopy(model)


def close(actual, expected, what="", rtol=RTOL, atol_rel=PARAM_ATOL, magnitude=None):
    """assert_close with rtol and an atol of atol_rel times the magnitude
    (by default the expected tensor's largest absolute value)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    if magnitude is None:
        magnitude = expected.detach().abs().max().item()
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol_rel * magnitude,
                               msg=lambda m: f"{what}: {m}")


def assert_params_match(got_params, want_params, what="param", initial=None, **kw):
    """Parity of params. With initial (the params before the run) the magnitude
    of each tensor is the largest of its initial and final values: an element
    that shrank carries the roundings of the larger values it had."""
    got_params, want_params = list(got_params), list(want_params)
    assert len(got_params) == len(want_params)
    for i, (a, b) in enumerate(zip(got_params, want_params)):
        if initial is not None and b.numel():
            kw["magnitude"] = max(b.detach().abs().max().item(), initial[i].abs().max().item())
        close(a, b, f"{what}[{i}] {tuple(b.shape)}", **kw)


def assert_states_match(fused_opt, fused_params, torch_opt, torch_params, keys=("exp_avg", "exp_avg_sq"),
                        atol_rel=STATE_ATOL, list_magnitude=False):
    """FusedAdam's states against torch's. With list_magnitude the absolute
    tolerance is relative to the largest value of that state over all params
    (for lists of tiny tensors, where one tensor's own maximum can be far below
    the terms its values were computed from)."""
    mags = {}
    if list_magnitude:
        for k in keys:
            mags[k] = max(torch_opt.state[b][k].abs().max().item() for b in torch_params if b.numel())
    for i, (a, b) in enumerate(zip(fused_params, torch_params)):
        for k in keys:
            got = true_state(fused_opt, a, k)
            close(got, torch_opt.state[b][k].to(got.dtype), f"state[{i}]['{k}'] {tuple(b.shape)}",
                  atol_rel=atol_rel, magnitude=mags.get(k))


def true_state(opt, p, key):
    """A FusedAdam state as true fp32 values (fp16 states divided by their scale)."""
    st = opt.state[p]
    value = st[key].to(F32)
    scale = st.get(key + "_scale")
    return value / scale if scale is not None else value


def state_tensors(opt, params):
    """Every state tensor FusedAdam keeps for params (views and 0-d scales)."""
    out = []
    for p in params:
        for k in sorted(opt.state[p]) if p in opt.state else []:
            v = opt.state[p][k]
            if isinstance(v, torch.Tensor):
                out.append((k, v))
    return out


def snapshot_opt(opt, params):
    """Bit-exact copies of params, every state tensor and the groups' step counters."""
    return {
        "params": [p.detach().clone() for p in params],
        "state": [(k, v.detach().clone()) for k, v in state_tensors(opt, params)],
        "steps": [_step_value(g["step"]) for g in opt.param_groups],
    }


def _step_value(step):
    return step.detach().clone() if isinstance(step, torch.Tensor) else step


def assert_opt_unchanged(opt, params, snap, what=""):
    for i, (p, p0) in enumerate(zip(params, snap["params"])):
        assert_bits_equal(p, p0, f"{what}: param[{i}]")
    now = state_tensors(opt, params)
    assert [k for k, _ in now] == [k for k, _ in snap["state"]], f"{what}: state keys changed"
    for (k, v), (_, v0) in zip(now, snap["state"]):
        assert_bits_equal(v, v0, f"{what}: state '{k}'")
    steps = [_step_value(g["step"]) for g in opt.param_groups]
    assert len(steps) == len(snap["steps"]), f"{what}: number of groups changed"
    for a, b in zip(steps, snap["steps"]):
        if isinstance(a, torch.Tensor):
            assert_bits_equal(a, b, f"{what}: step counter")
        else:
            assert a == b, f"{what}: step counter {a} != {b}"


class RefParam:
    """A float64 reference trajectory for one parameter (tests/reference.py)."""

    def __init__(self, p, amsgrad=False):
        self.p = p.detach().double().cpu().reshape(-1).clone()
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)
        self.vmax = torch.zeros_like(self.p) if amsgrad else None

    def step(self, grad, step: int, h: AdamHyper):
        r = adam_step(self.p, grad, self.m, self.v, self.vmax, step=step, h=h)
        self.p, self.m, self.v, self.vmax = r.param, r.exp_avg, r.exp_avg_sq, r.max_exp_avg_sq


def assert_nested_equal(a, b, path="sd"):
    """Deep equality of (state-dict-like) nested containers; tensors with torch.equal."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, f"{path}: tensor meta differs"
        assert torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())), \
            f"{path}: tensor values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_nested_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_state_dicts_bit_equal(got, want, path="state_dict"):
    """Like assert_nested_equal, but tensors compared bit for bit (NaNs included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert_bits_equal(got, want, path)
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_state_dicts_bit_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (x, y) in enumerate(zip(got, want)):
            assert_state_dicts_bit_equal(x, y, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"
