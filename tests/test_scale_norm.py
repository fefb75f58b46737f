"""kernels.scale / kernels.copy / kernels.l2_norm."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, randn, snapshot
from shardadam import kernels

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]
DNAME = {F32: "f32", F16: "f16", BF16: "bf16"}
SIZES = [0, 1, 4099, 70001, 0]


def wide_range(n, dtype, device):
    """Random values over many magnitudes (subnormal to large for the dtype), never all zero."""
    hi = {F32: 30, F16: 4, BF16: 30}[dtype]
    lo = {F32: -40, F16: -7, BF16: -40}[dtype]
    t = torch.randn(n, dtype=torch.float64) * 10.0 ** (torch.rand(n, dtype=torch.float64) * (hi - lo) + lo)
    return t.to(dtype).to(device)


def torch_scale(x: torch.Tensor, s: float, out_dtype) -> torch.Tensor:
    return (x.float() * torch.tensor(s, dtype=torch.float32, device=x.device)).to(out_dtype)


@pytest.mark.parametrize("factor", [0.37, 2.0 ** -10, -3.0, 1e5])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: "out_" + DNAME[d])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=lambda d: "in_" + DNAME[d])
def test_scale_matches_torch(device, in_dtype, out_dtype, factor):
    inputs = [wide_range(n, in_dtype, device) for n in SIZES]
    before = snapshot(inputs)
    outputs = [torch.full((n,), 5.0, dtype=out_dtype, device=device) for n in SIZES]
    flag = torch.zeros(1, device=device)
    kernels.scale(inputs, outputs, factor, found_inf=flag)
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        assert_bits_equal(y, torch_scale(x, factor, out_dtype), f"outputs[{i}]")
    assert_all_bits_equal(inputs, before, "inputs")
    assert flag.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DNAME[d])
def test_scale_in_place(device, dtype):
    tensors = [randn(n, dtype, device) for n in SIZES]
    want = [torch_scale(t, 0.37, dtype) for t in tensors]
    kernels.scale(tensors, tensors, 0.37)
    assert_all_bits_equal(tensors, want, "outputs is inputs")
    again = [torch_scale(t, 2.5, dtype) for t in tensors]
    kernels.scale(tensors, list(tensors), torch.tensor(2.5, device=device))
    assert_all_bits_equal(tensors, again, "outputs a copy of the inputs list, tensor scale")


def test_scale_plan_reuse(device):
    x = [randn(n, device=device) for n in SIZES]
    y = [torch.empty(n, dtype=BF16, device=device) for n in SIZES]
    plan = kernels.ScalePlan(x, y)
    for s in (0.5, 3.0, -0.1):
        kernels.scale(plan, scale=s)
        assert_all_bits_equal(y, [torch_scale(t, s, BF16) for t in x], f"scale {s}")


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("in_dtype", DTYPES, ids=lambda d: DNAME[d])
def test_scale_found_inf_set_by_nonfinite_input(device, in_dtype, bad):
    inputs = [randn(n, in_dtype, device) for n in SIZES]
    inputs[3][54321] = float(bad)
    outputs = [torch.empty(n, device=device) for n in SIZES]
    flag = torch.zeros(1, device=device)
    kernels.scale(inputs, outputs, 0.5, found_inf=flag)
    assert flag.item() == 1.0
    # Finite inputs elsewhere are still scaled.
    assert_bits_equal(outputs[2], torch_scale(inputs[2], 0.5, F32), "outputs[2]")


def test_scale_found_inf_not_set_by_large_finite_values(device):
    x = randn(4099, device=device)
    x[7] = 3e38
    x[8] = -3.4028234663852886e38  # -FLT_MAX
    flag = torch.zeros(1, device=device)
    y = torch.empty_like(x)
    kernels.scale(x, y, 1.0, found_inf=flag)
    assert flag.item() == 0.0
    assert_bits_equal(y, x, "copy of large values")
    # The flag is about the inputs: a finite input that overflows fp16 output does not set it.
    y16 = torch.empty(4099, dtype=F16, device=device)
    kernels.scale(x, y16, 1.0, found_inf=flag)
    assert flag.item() == 0.0 and bool(torch.isinf(y16[7])) and bool(torch.isinf(y16[8]))


def test_scale_found_inf_is_never_cleared(device):
    flag = torch.ones(1, device=device)
    x = randn(100, device=device)
    kernels.scale(x, torch.empty_like(x), 2.0, found_inf=flag)
    assert flag.item() == 1.0


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: DNAME[d])
def test_copy_converts_and_skip_if_writes_nothing(device, out_dtype):
    x = [randn(n, device=device) for n in SIZES]
    y = [torch.full((n,), -1.0, dtype=out_dtype, device=device) for n in SIZES]
    before = snapshot(y)
    skip = torch.ones(1, device=device)
    kernels.copy(x, y, skip_if=skip)
    assert_all_bits_equal(y, before, "copy with skip_if set")
    kernels.scale(x, y, 3.0, skip_if=skip)
    assert_all_bits_equal(y, before, "scale with skip_if set")
    skip.zero_()
    kernels.copy(x, y, skip_if=skip)
    assert_all_bits_equal(y, [t.to(out_dtype) for t in x], "copy")


# ---------------------------------------------------------------- l2_norm

def f64_norm(t: torch.Tensor) -> float:
    return t.double().norm().item() if t.numel() else 0.0


def norm_inputs(device):
    return [torch.empty(0, device=device), randn(1, device=device), randn(4099, device=device, scale=100.0),
            randn(70001, F16, device), torch.empty(0, dtype=BF16, device=device), randn(270000, BF16, device),
            randn(3, device=device, scale=1e-20), torch.empty(0, device=device)]


def test_l2_norm_matches_float64(device):
    ts = norm_inputs(device)
    r = kernels.l2_norm(ts, per_tensor=True)
    want = torch.tensor([f64_norm(t) for t in ts], dtype=torch.float64)
    assert r.per_tensor.dtype == F32 and r.per_tensor.shape == (len(ts),)
    assert r.total.dtype == F32 and r.total.shape == ()
    assert r.nonfinite.dtype == F32 and r.nonfinite.shape == (1,) and r.nonfinite.item() == 0.0
    torch.testing.assert_close(r.per_tensor.double().cpu(), want, rtol=1e-5, atol=0)
    assert r.per_tensor[0].item() == 0.0 and r.per_tensor[4].item() == 0.0 and r.per_tensor[7].item() == 0.0
    total = torch.cat([t.double().reshape(-1).cpu() for t in ts]).norm()
    torch.testing.assert_close(r.total.double().cpu(), total, rtol=1e-5, atol=0)
    assert kernels.l2_norm(ts).per_tensor is None


def test_l2_norm_of_only_empty_tensors(device):
    r = kernels.l2_norm([torch.empty(0, device=device), torch.empty(0, dtype=F16, device=device)], per_tensor=True)
    assert r.total.item() == 0.0 and r.per_tensor.tolist() == [0.0, 0.0] and r.nonfinite.item() == 0.0


def test_l2_norm_single_tensor(device):
    t = randn(100003, device=device)
    r = kernels.l2_norm(t, per_tensor=True)
    torch.testing.assert_close(r.total.double().cpu(), torch.tensor(f64_norm(t), dtype=torch.float64),
                               rtol=1e-5, atol=0)
    assert_bits_equal(r.per_tensor[0], r.total, "per-tensor norm of the only tensor")


@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_l2_norm_nonfinite(device, bad):
    ts = norm_inputs(device)
    ts[5][123456] = float(bad)
    r = kernels.l2_norm(ts, per_tensor=True)
    assert r.nonfinite.item() == 1.0
    if bad == "inf":
        assert r.total.item() == float("inf") and r.per_tensor[5].item() == float("inf")
    else:
        assert bool(torch.isnan(r.total)) and bool(torch.isnan(r.per_tensor[5]))
    # The other tensors' norms are unaffected.
    torch.testing.assert_close(r.per_tensor[2].double().cpu(), torch.tensor(f64_norm(ts[2]), dtype=torch.float64),
                               rtol=1e-5, atol=0)


def test_l2_norm_given_found_inf_is_set_never_cleared(device):
    ts = norm_inputs(device)
    flag = torch.zeros(1, device=device)
    r = kernels.l2_norm(ts, found_inf=flag)
    assert r.nonfinite is flag and flag.item() == 0.0
    flag.fill_(1.0)
    kernels.l2_norm(ts, found_inf=flag)
    assert flag.item() == 1.0
    flag.zero_()
    ts[3][0] = float("-inf")
    kernels.l2_norm(ts, found_inf=flag)
    assert flag.item() == 1.0


def test_l2_norm_large_finite_values_overflow_without_flag(device):
    """1e30 squared overflows fp32: the norm is inf, but nonfinite flags only
    inf/NaN inputs, and these inputs are finite."""
    ts = [randn(1000, device=device), torch.full((10,), 1e30, device=device), randn(7, device=device)]
    r = kernels.l2_norm(ts, per_tensor=True)
    assert r.total.item() == float("inf")
    assert r.per_tensor[1].item() == float("inf")
    assert r.nonfinite.item() == 0.0
    torch.testing.assert_close(r.per_tensor[0].double().cpu(), torch.tensor(f64_norm(ts[0]), dtype=torch.float64),
                               rtol=1e-5, atol=0)


def test_l2_norm_is_deterministic(device):
    ts = norm_inputs(device) + [randn(1 << 20, device=device)]
    a = kernels.l2_norm(ts, per_tensor=True)
    b = kernels.l2_norm(ts, per_tensor=True)
    plan = kernels.NormPlan(ts)
    c = kernels.l2_norm(plan, per_tensor=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        d = kernels.l2_norm(plan, per_tensor=True)
    finally:
        torch.set_num_threads(threads)
    for name, other in (("second call", b), ("plan", c), ("one thread", d)):
        assert_bits_equal(other.total, a.total, f"{name}: total")
        assert_bits_equal(other.per_tensor, a.per_tensor, f"{name}: per_tensor")
