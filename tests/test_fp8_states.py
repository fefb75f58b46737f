"""FP8 E4M3 optimizer states (TransformerEngine's exp_avg_dtype=torch.uint8,
stored as torch.float8_e4m3fn with a power-of-two scale per tensor:
[Note: storage codecs] in _storage.py). References: torch's own float8_e4m3fn
conversion for the core's encode and decode, and torch's AdamW whose states
are replaced, after every step, by their FP8-quantized values (what the
storage keeps), for the update."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import shardadam
from shardadam import kernels

F8 = torch.float8_e4m3fn


def _grid_and_ties() -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours (ties) and the
    floats next to them, and random values over the whole range, all below 464."""
    grid = torch.arange(256, dtype=torch.uint8).view(F8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:].double() + grid[:-1].double()).div(2).float()
    near = torch.cat([mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf)), grid])
    g = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 1e-1, 1.0, 30.0, 150.0)])
    values = torch.cat([near, spread])
    return values[values.abs() < 464]


def test_encode_and_decode_are_torchs_bit_for_bit(device):
    values = _grid_and_ties().to(device)
    encoded = torch.empty_like(values, dtype=F8)
    kernels.scale([values], [encoded], 1.0)
    assert torch.equal(encoded.view(torch.uint8).cpu(), values.cpu().to(F8).view(torch.uint8))
    decoded = torch.empty_like(values)
    kernels.scale([encoded], [decoded], 1.0)
    assert torch.equal(decoded.cpu(), encoded.cpu().float())


def test_non_finite_and_out_of_range_values_become_nan(device):
    values = torch.tensor([math.inf, -math.inf, math.nan, 464.0, -1e6], device=device)
    encoded = torch.empty_like(values, dtype=F8)
    kernels.scale([values], [encoded], 1.0)
    assert encoded.float().isnan().all()


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """t as FP8 storage keeps it: times the power of two that puts its absolute
    maximum in [128, 256), rounded to E4M3 by torch, divided back."""
    amax = t.abs().max().item()
    if amax == 0:
        return t.clone()
    scale = 2.0 ** (8 - math.frexp(amax)[1])
    return (t * scale).to(F8).float() / scale


@pytest.mark.parametrize("lion", [False, True], ids=["adam", "lion"])
def test_steps_equal_adamw_on_quantized_states(device, lion):
    """Four steps of a two-tensor model: the parameters equal the reference's
    within fp32 rounding, and the stored states dequantize to the
    reference's quantized states (one FP8 step apart at most, where fp32
    rounding of the update put a value on the other side of a tie)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16).to(device)
    want = [p.detach().clone().requires_grad_() for p in model.parameters()]
    if lion:
        from torch_lion import TorchLion
        opt = shardadam.FusedLion(model.parameters(), lr=1e-2, weight_decay=0.1, exp_avg_dtype=F8)
        reference = TorchLion(want, lr=1e-2, weight_decay=0.1)
        names = ("exp_avg",)
    else:
        opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.uint8,
                                  exp_avg_sq_dtype=torch.uint8)
        reference = torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, foreach=False)
        names = ("exp_avg", "exp_avg_sq")
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in want]
        for p, q, grad in zip(model.parameters(), want, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
        with torch.no_grad():
            for q in want:
                for name in names:
                    reference.state[q][name].copy_(_quantized(reference.state[q][name]))
    for p, q in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for name in names:
            assert opt.state[p][name].dtype == F8
            got = opt.state[p][name].float() / opt.state[p][f"{name}_scale"]
            expect = reference.state[q][name]
            step = expect.abs().max() * 2.0 ** -3  # one FP8 step at the top of the range
            assert (got - expect).abs().max() <= step, name
            assert (got != expect).float().mean() < 0.01, name


def test_checkpoints_hold_true_values_and_load_across_storage(device):
    """state_dict() saves fp32 values; an fp32-state optimizer loads them and
    saves the same dict; loading that back into FP8 storage gives the same
    values (the scale may be half the kernel's: a value that rounded up to
    2^8 times the scale sets the maximum the load sees)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16).to(device)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    saved = opt.state_dict()
    assert all(v.dtype == torch.float32 for e in saved["state"].values() for k, v in e.items() if k != "step")
    fp32 = shardadam.FusedAdam(model.parameters(), lr=1e-2)
    fp32.load_state_dict(saved)
    again = fp32.state_dict()
    for k, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(again["state"][k][name], value), (k, name)
    back = shardadam.FusedAdam(model.parameters(), lr=1e-2, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)
    back.load_state_dict(again)
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.get_unscaled_state(p, name), opt.get_unscaled_state(p, name)), name


@pytest.mark.cuda
def test_cpu_and_cuda_store_the_same_bytes():
    def run(device):
        p = nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(device))
        opt = shardadam.FusedAdam([p], lr=1e-2, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = torch.randn(4096, generator=g).to(device)
            opt.step()
        return p.detach().cpu(), [opt.state[p][n].view(torch.uint8).cpu() for n in ("exp_avg", "exp_avg_sq")]
    (p_cpu, s_cpu), (p_gpu, s_gpu) = run("cpu"), run("cuda")
    torch.testing.assert_close(p_gpu, p_cpu, rtol=1e-6, atol=1e-7)
    for a, b in zip(s_cpu, s_gpu):
        assert (a != b).float().mean() < 1e-3  # fp32 rounding may flip a tie


# ------------------------------------------------------------ DistributedFusedAdam

def _fp8_run(optimizer, steps: int = 5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = optimizer(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 32, generator=g)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_distributed_fp8_states_are_fused_adams_where_fragments_are_whole(one_rank):
    """One rank, one bucket: every shard fragment is a whole parameter, so its
    scale is FusedAdam's per-tensor scale and the runs agree bit for bit."""
    kw = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    fused_model, fused = _fp8_run(lambda ps: shardadam.FusedAdam(ps, **kw))
    dist_model, dist_opt = _fp8_run(lambda ps: shardadam.DistributedFusedAdam(
        ps, bucket_cap_mb=100, overlap_grad_sync=False, **kw))
    assert dist_opt.states["exp_avg"].dtype == F8 and set(dist_opt.state_scales) == {"exp_avg", "exp_avg_sq"}
    for p, q in zip(fused_model.parameters(), dist_model.parameters()):
        assert torch.equal(p, q)
    saved, mine = fused.state_dict()["state"], dist_opt.state_dict()["state"]
    for k in saved:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[k][name], saved[k][name]), (k, name)


def test_distributed_fp8_checkpoint_loads_into_other_storage(one_rank):
    """Small buckets (parameters split over fragments, a scale each): the
    portable state dict holds fp32 values that an fp32-state optimizer loads
    and gives back unchanged."""
    kw = dict(lr=1e-2, bucket_cap_mb=1e-4, overlap_grad_sync=False)
    model, opt = _fp8_run(lambda ps: shardadam.DistributedFusedAdam(ps, exp_avg_dtype=F8, exp_avg_sq_dtype=F8, **kw))
    assert len(opt.state_scales["exp_avg"]) > len(list(model.parameters()))
    saved = opt.state_dict()
    fp32 = shardadam.DistributedFusedAdam(model.parameters(), **kw)
    fp32.load_state_dict(saved)
    again = fp32.state_dict()["state"]
    for k, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(again[k][name], value), (k, name)


@pytest.mark.parametrize("kw, match", [
    (dict(exp_avg_dtype=torch.int8), r"exp_avg_dtype must be torch.float32, torch.float16, torch.bfloat16 or FP8"),
    (dict(exp_avg_sq_dtype=F8), r"exp_avg_sq_dtype: Lion keeps no exp_avg_sq"),
])
def test_distributed_state_dtype_refusals(one_rank, kw, match):
    model = nn.Linear(4, 4)
    cls = shardadam.DistributedFusedLion if "sq" in next(iter(kw)) else shardadam.DistributedFusedAdam
    with pytest.raises(ValueError, match=match):
        cls(model.parameters(), **kw)
