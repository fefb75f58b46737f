"""FP8 E4M3 optimizer states (TransformerEngine's exp_avg_dtype=torch.uint8,
stored as torch.float8_e4m3fn with a power-of-two scale per tensor:
[Note: storage codecs] in _storage.py; an FP8 exp_avg_sq is kept in the
blockwise 8-bit code: [Note: FP8 second moments]). References: torch's own
float8_e4m3fn conversion for the core's encode and decode, and torch's AdamW
whose states are replaced, after every step, by their quantized values (what
the storage keeps), for the update."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import shardadam
from conftest import assert_all_bits_equal
from shardadam import kernels
from storage_checks import (assert_blockwise_state, blockwise_quantized, distributed_equals_fused,
                            distributed_reloaded_through_fp32, lion_or_adamw, reloaded_through_fp32,
                            steps_on_cpu_and_cuda, steps_on_quantized_states)

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
    """NaN with the value's sign from 464 up and for infinities (where the
    GPU's conversion saturates to 448), the same bytes on both engines. (A
    NaN's own sign is not compared: scale multiplies first, and the GPU's
    arithmetic returns its canonical NaN.)"""
    special = torch.tensor([math.inf, -math.inf, math.nan, 464.0, -464.0, -1e6, 463.9, -448.0])
    codes = torch.tensor([0x7f, 0xff, 0x7f, 0x7f, 0xff, 0xff, 0x7e, 0xfe], dtype=torch.uint8)
    # Codes to mend in every lane of a tile, tiles with none, and a mix.
    values = torch.cat([special, torch.ones(8), special.flip(0), torch.ones(3)]).to(device)
    expected = torch.cat([codes, torch.full((8,), 0x38, dtype=torch.uint8), codes.flip(0),
                          torch.full((3,), 0x38, dtype=torch.uint8)])  # 0x38: 1.0
    encoded = torch.empty_like(values, dtype=F8)
    kernels.scale([values], [encoded], 1.0)
    assert torch.equal(encoded.view(torch.uint8).cpu(), expected)


def test_every_code_decodes_to_torchs_value(device):
    """Every finite code decodes to torch's value bit for bit and the NaN codes to NaN, in a tile of
    FP8 codes with NaN codes and in tiles without."""
    codes = torch.arange(256, dtype=torch.uint8).view(F8)
    decoded = torch.empty(256, device=device)
    kernels.scale([codes.to(device)], [decoded], 1.0)
    nan = torch.zeros(256, dtype=torch.bool)
    nan[0x7f] = nan[0xff] = True
    assert torch.equal(decoded.cpu().isnan(), nan)
    assert torch.equal(decoded.cpu()[~nan].view(torch.int32), codes.float()[~nan].view(torch.int32))


def _encoded(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """t's FP8 codes under the power of two that puts its absolute maximum in
    [128, 256) (torch's rounding), and that scale."""
    scale = 2.0 ** (8 - math.frexp(t.abs().max().item())[1])
    return (t * scale).to(F8), scale


def _quantized(t: torch.Tensor) -> torch.Tensor:
    """t as FP8 storage keeps it: its codes (_encoded) divided back."""
    codes, scale = _encoded(t)
    return codes.float() / scale


def _kept(state: torch.Tensor, name: str) -> torch.Tensor:
    """What FP8 storage keeps of a state: E4M3 under a per-tensor scale, or
    for exp_avg_sq the blockwise 8-bit code ([Note: FP8 second moments])."""
    return blockwise_quantized(state, signed=False)[0] if name == "exp_avg_sq" else _quantized(state)


@pytest.mark.parametrize("kind", [torch.uint8, F8], ids=["te-uint8", "float8_e4m3fn"])
@pytest.mark.parametrize("lion", [False, True], ids=["adam", "lion"])
def test_steps_equal_adamw_on_quantized_states(device, lion, kind):
    """Four steps of a two-tensor model: the parameters equal the reference's
    within fp32 rounding, and the stored states dequantize to the
    reference's quantized states (one FP8 step apart at most, where fp32
    rounding of the update put a value on the other side of a tie; the
    second moment as the blockwise states are checked)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16).to(device)
    opt, reference, want, names = lion_or_adamw(model, lion, exp_avg_dtype=kind, exp_avg_sq_dtype=kind)
    steps_on_quantized_states(model, opt, reference, want, names, _kept)
    for p, q in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        assert "exp_avg_sq_scale" not in opt.state[p]
        for name in names:
            if name == "exp_avg_sq":
                assert_blockwise_state(opt, p, name, reference.state[q][name])
                continue
            assert opt.state[p][name].dtype == F8
            got = opt.state[p][name].float() / opt.state[p][f"{name}_scale"]
            expect = reference.state[q][name]
            step = expect.abs().max() * 2.0 ** -3  # one FP8 step at the top of the range
            assert (got - expect).abs().max() <= step, name
            assert (got != expect).float().mean() < 0.01, name


@pytest.mark.parametrize("params", ["fp32", "fp32+bf16-copy", "bf16-stochastic"])
@pytest.mark.parametrize("rule", ["adamw", "adam-l2", "lion"])
def test_step_equals_the_fp32_step_then_quantized(device, rule, params):
    """One step from FP8 states against the step from the fp32 values they
    decode to: the same parameters within fp32 rounding (the two tables may
    run kernels that contract the update's multiply-adds differently; bf16
    parameters rounded stochastically by the same bits are then rarely one
    bf16 step apart), bf16 copies that are the stored parameters rounded,
    and each new state stored as torch's E4M3 rounding of the fp32 step's
    state under the scale its new maximum gives (but for rare ties, one code
    apart). In AdamW and Lion the first pass stores the parameters and the
    second the states only; in Adam's L2 mode, whose states read the
    parameter, the second pass stores both ([Note: params in the measure
    pass] in cpp/ops.h)."""
    sizes = [1000, 4099, 3]
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if params == "bf16-stochastic" else torch.float32
    p0 = [torch.randn(n, generator=gen).to(device, dtype) for n in sizes]
    grads = [torch.randn(n, generator=gen).mul(1e-2).to(device, dtype) for n in sizes]
    rounding = dict(stochastic_rounding_seed=1234) if params == "bf16-stochastic" else {}
    names = ("exp_avg",) if rule == "lion" else ("exp_avg", "exp_avg_sq")
    init = {"exp_avg": [torch.randn(n, generator=gen) * 1e-2 for n in sizes],
            "exp_avg_sq": [torch.rand(n, generator=gen) * 1e-4 for n in sizes]}
    codes = {name: [_encoded(t) for t in init[name]] for name in names}

    def run(fp8: bool):
        p = [t.clone() for t in p0]
        states = {name: [(c.to(device, copy=True) if fp8 else c.float().div(s).to(device)) for c, s in codes[name]]
                  for name in names}
        kw = {f"{name}_scales": torch.tensor([s for _, s in codes[name]], device=device)
              for name in names} if fp8 else {}
        out = [torch.empty_like(t, dtype=torch.bfloat16) for t in p] if params == "fp32+bf16-copy" else None
        lists = [states[name] for name in names]
        if rule == "lion":
            kernels.lion(p, grads, *lists, lr=1e-2, weight_decay=0.1, params_out=out, **kw, **rounding)
        else:
            kernels.adam(p, grads, *lists, lr=1e-2, step=3, weight_decay=0.1, adam_w_mode=rule == "adamw",
                         params_out=out, **kw, **rounding)
        return p, out, states, kw

    p8, out8, states8, scales8 = run(fp8=True)
    p32, _, states32, _ = run(fp8=False)
    for i, (got, want) in enumerate(zip(p8, p32)):
        if dtype == torch.bfloat16:
            off = (got.cpu().view(torch.int16).int() - want.cpu().view(torch.int16).int()).abs()
            assert off.max() <= 1 and (off != 0).float().mean() < 1e-3, f"params[{i}]"
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"params[{i}]: {m}")
    if params == "fp32+bf16-copy":
        assert_all_bits_equal(out8, [t.to(torch.bfloat16) for t in p8], "params_out")
    for name in names:
        for i, (stored, want) in enumerate(zip(states8[name], states32[name])):
            code, scale = _encoded(want.cpu())
            assert scales8[f"{name}_scales"][i].item() == scale, f"{name}[{i}] scale"
            off = (stored.cpu().view(torch.uint8).int() - code.view(torch.uint8).int()).abs()
            assert off.max() <= 1 and (off != 0).float().mean() < 1e-3, f"{name}[{i}]: {int((off != 0).sum())} codes"


def test_checkpoints_hold_true_values_and_load_across_storage(device):
    """state_dict() saves fp32 values; an fp32-state optimizer loads them and
    saves the same dict; loading that back into FP8 storage gives the same
    values (the scale may be half the kernel's: a value that rounded up to
    2^8 times the scale sets the maximum the load sees)."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16).to(device)
    opt, back = reloaded_through_fp32(model, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.get_unscaled_state(p, name), opt.get_unscaled_state(p, name)), name


@pytest.mark.cuda
def test_cpu_and_cuda_store_the_same_bytes():
    steps_on_cpu_and_cuda(4096, exp_avg_dtype=F8, exp_avg_sq_dtype=F8)


# ------------------------------------------------------------ DistributedFusedAdam

def test_distributed_fp8_states_are_fused_adams_where_fragments_are_whole(one_rank):
    """One rank, one bucket: every shard fragment is a whole parameter, so its
    scale is FusedAdam's per-tensor scale and the runs agree bit for bit."""
    dist_opt = distributed_equals_fused(dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8))
    assert dist_opt.states["exp_avg"].dtype == F8 and set(dist_opt.state_scales) == {"exp_avg"}
    assert dist_opt.states["exp_avg_sq"].dtype == torch.uint8 and set(dist_opt.state_blocks) == {"exp_avg_sq"}


def test_distributed_fp8_checkpoint_loads_into_other_storage(one_rank):
    """Small buckets (parameters split over fragments, a scale each): the
    portable state dict holds fp32 values that an fp32-state optimizer loads
    and gives back unchanged."""
    model, opt, _, _ = distributed_reloaded_through_fp32(dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8), 1e-4)
    assert len(opt.state_scales["exp_avg"]) > len(list(model.parameters()))


@pytest.mark.parametrize("kw, match", [
    (dict(exp_avg_dtype=torch.int8), r"exp_avg_dtype must be torch.float32, torch.float16, torch.bfloat16, FP8 .* "
                                     r"or 'blockwise8'"),
    (dict(exp_avg_sq_dtype=F8), r"exp_avg_sq_dtype: Lion keeps no exp_avg_sq"),
])
def test_distributed_state_dtype_refusals(one_rank, kw, match):
    model = nn.Linear(4, 4)
    cls = shardadam.DistributedFusedLion if "sq" in next(iter(kw)) else shardadam.DistributedFusedAdam
    with pytest.raises(ValueError, match=match):
        cls(model.parameters(), **kw)


def test_second_moments_over_decades_follow_adamw(device):
    """Rare tokens of an embedding: blocks of a tensor whose gradients lie
    three decades apart, all with gradients on the first step and only the
    first block after. Under one E4M3 scale per tensor the small blocks'
    second moments rounded to zero while their first moments did not, and
    the next steps moved them by m / eps (about 10^3 lr); kept blockwise
    ([Note: FP8 second moments]) every entry moves as it does with an fp32
    exp_avg_sq (within the 8-bit code's rounding), and no entry further than
    torch's fp32 AdamW moves any. (Entries whose first moment falls below
    E4M3's range under the tensor's scale stop early in both: FP8 exp_avg's
    own limit, 2^-17 below the tensor's largest.)"""
    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(0, -3, 4).repeat_interleave(256)
    grads = [torch.randn(1024, generator=gen) * scale * 1e-2 for _ in range(5)]
    for g in grads[1:]:
        g[256:] = 0
    p0 = torch.randn(1024, generator=gen)

    def moved(make) -> torch.Tensor:
        p = p0.clone().to(device).requires_grad_()
        opt = make(p)
        for g in grads:
            p.grad = g.to(device)
            opt.step()
        return p.detach().cpu() - p0

    fp8 = moved(lambda p: shardadam.FusedAdam([p], lr=1e-3, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8))
    exact_v = moved(lambda p: shardadam.FusedAdam([p], lr=1e-3, exp_avg_dtype=torch.uint8))
    adamw = moved(lambda p: torch.optim.AdamW([p], lr=1e-3, weight_decay=0.0, foreach=False))
    assert adamw.abs().max() < 5e-3  # about lr a step
    assert fp8.abs().max() <= 1.05 * adamw.abs().max()
    assert (fp8 - exact_v).abs().max() <= 0.1 * adamw.abs().max()
    assert torch.linalg.vector_norm(fp8 - exact_v) <= 0.02 * torch.linalg.vector_norm(adamw)
