"""Blockwise 8-bit optimizer states (exp_avg_dtype="blockwise8": [Note:
blockwise 8-bit states] in cpp/dtype.h). References, written here from the
documented map: the map built in float64, the nearest map value found by
search over all 256 codes, and torch's AdamW whose states are replaced after
every step by their quantized values (what the storage keeps)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import shardadam
from shardadam import kernels
from storage_checks import (BLOCK, assert_blockwise_state, blockwise_quantized, blockwise_reference_map,
                            blockwise_rows, captured_against_eager, distributed_equals_fused,
                            distributed_reloaded_through_fp32, lion_or_adamw, reloaded_through_fp32, small_model_run,
                            steps_on_cpu_and_cuda, steps_on_quantized_states)

Q8 = shardadam.BLOCKWISE8


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_map_is_the_documented_one(signed):
    got = kernels.q8_map(signed)
    assert torch.equal(got, blockwise_reference_map(signed))
    magnitudes = got.abs().unique()
    assert magnitudes[0] == 0 and magnitudes[-1] == 1.0
    assert len(magnitudes) == (128 if signed else 256)
    assert magnitudes[1] == (1e-6 if signed else 1e-7) or math.isclose(magnitudes[1].item(),
                                                                        1e-6 if signed else 1e-7, rel_tol=1e-6)


def _check_nearest(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """absmax is each block's largest magnitude exactly, and every code's map
    value is the nearest to value / absmax (as the kernel forms it in float32),
    up to one float32 rounding of a tie."""
    table = blockwise_reference_map(signed).double()
    rows = blockwise_rows(values.cpu())
    assert torch.equal(absmax.cpu().double(), rows.abs().amax(dim=1))
    inv = torch.where(absmax.cpu() > 0, 1.0 / absmax.cpu(), torch.zeros_like(absmax.cpu()))
    y = (rows.float() * inv[:, None]).double().reshape(-1)[:values.numel()]
    if not signed:
        y = y.clamp(min=0)
    got = table[codes.cpu().reshape(-1).long()]
    best = (y[:, None] - table[None, :]).abs().amin(dim=1)
    assert ((got - y).abs() <= best + 1e-7 * y.abs() + 1e-12).all()


def _samples(n: int, generator: torch.Generator) -> torch.Tensor:
    """Values over many magnitudes, with a block of zeros and a lone value."""
    x = torch.randn(n, generator=generator) * torch.logspace(-8, 2, n).pow(torch.rand(n, generator=generator))
    x[BLOCK:2 * BLOCK] = 0
    x[2 * BLOCK + 7] = 3.0
    return x


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_rounds_to_the_nearest_map_value(device, signed):
    g = torch.Generator().manual_seed(0)
    values = _samples(20 * BLOCK + 77, g)  # a partial last block
    if not signed:
        values = values.abs()
    values = values.to(device)
    codes = torch.empty(values.shape, dtype=torch.uint8, device=device)
    absmax = torch.empty(-(-values.numel() // BLOCK), device=device)
    kernels.blockwise_quantize(values, codes, absmax, signed=signed)
    _check_nearest(values, codes, absmax, signed)
    decoded = torch.empty_like(values)
    kernels.blockwise_dequantize(codes, absmax, decoded, signed=signed)
    table = blockwise_reference_map(signed)
    expect = table[codes.cpu().long()] * absmax.cpu().repeat_interleave(BLOCK)[:values.numel()]
    assert torch.equal(decoded.cpu(), expect)
    # Encoding decoded values gives back the same codes and maxima.
    again, again_max = torch.empty_like(codes), torch.empty_like(absmax)
    kernels.blockwise_quantize(decoded, again, again_max, signed=signed)
    assert torch.equal(again, codes) and torch.equal(again_max, absmax)


def test_blocks_follow_each_tensors_memory_order(device):
    """Blocks start at each tensor's first element; a channels_last tensor is
    cut in its memory order."""
    x = torch.randn(2, 3, 16, 16, device=device).to(memory_format=torch.channels_last)
    codes = torch.empty_like(x, dtype=torch.uint8)
    absmax = torch.empty(-(-x.numel() // BLOCK), device=device)
    kernels.blockwise_quantize([x], [codes], [absmax])
    in_memory = x.permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(absmax.cpu().double(), blockwise_rows(in_memory.cpu()).abs().amax(dim=1))


def test_unsigned_map_takes_zero_and_negatives_as_zero(device):
    """-0.0 and negative values store as code 0 in the unsigned map (its
    value 0), on every engine alike; the block maximum is the largest
    magnitude, so a block of negatives keeps it."""
    x = torch.zeros(2 * BLOCK, device=device)
    x[0], x[1], x[2], x[BLOCK] = -0.0, -3.0, 2.0, -1.0
    x[3:BLOCK] = torch.linspace(-1.0, 1.0, BLOCK - 3, device=device)
    codes = torch.empty_like(x, dtype=torch.uint8)
    absmax = torch.empty(2, device=device)
    kernels.blockwise_quantize(x, codes, absmax, signed=False)
    negative_or_zero = (x <= 0).cpu()
    assert (codes.cpu()[negative_or_zero] == 0).all()
    assert absmax.cpu().tolist() == [3.0, 1.0]
    out = torch.empty_like(x)
    kernels.blockwise_dequantize(codes, absmax, out, signed=False)
    assert (out.cpu()[negative_or_zero] == 0).all() and not out.cpu()[negative_or_zero].signbit().any()


def test_non_finite_values_make_their_block_nan(device):
    x = torch.randn(3 * BLOCK, device=device)
    x[5], x[BLOCK + 9] = math.inf, math.nan
    codes = torch.empty_like(x, dtype=torch.uint8)
    absmax = torch.empty(3, device=device)
    kernels.blockwise_quantize(x, codes, absmax)
    out = torch.empty_like(x)
    kernels.blockwise_dequantize(codes, absmax, out)
    assert out[:2 * BLOCK].isnan().all() and out[2 * BLOCK:].isfinite().all()


@pytest.mark.parametrize("kw, match", [
    (dict(absmax_size=3), r"outputs_absmax\[0\] has 3 elements; it holds one float32 maximum per 256 elements"),
    (dict(absmax_dtype=torch.float16), r"outputs_absmax\[0\] has dtype float16"),
    (dict(no_absmax=True), r"outputs\[0\] is blockwise 8-bit but the table has no list of its block maxima"),
])
def test_quantize_refuses_bad_maxima(kw, match):
    x = torch.randn(1000)
    codes = torch.zeros(1000, dtype=torch.uint8)
    absmax = torch.zeros(kw.get("absmax_size", 4), dtype=kw.get("absmax_dtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        if kw.get("no_absmax"):
            kernels.copy(x, codes)
        else:
            kernels.blockwise_quantize(x, codes, absmax)
    assert codes.eq(0).all() and absmax.eq(0).all()


@pytest.mark.parametrize("lion", [False, True], ids=["adam", "lion"])
def test_steps_equal_adamw_on_quantized_states(device, lion):
    """Four steps of a model whose tensors hold several blocks: the
    parameters equal the reference's within fp32 rounding and the stored
    states decode to the reference's quantized ones (a value that fp32
    rounding put on the other side of a tie may differ by one map step; the
    block maxima may differ in the last bit where the compiler fused a
    multiply-add that torch rounds twice)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 48).to(device)
    opt, reference, want, names = lion_or_adamw(model, lion, exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8)
    steps_on_quantized_states(model, opt, reference, want, names,
                              lambda state, name: blockwise_quantized(state, signed=name != "exp_avg_sq")[0])
    for p, q in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        for name in names:
            assert_blockwise_state(opt, p, name, reference.state[q][name])


def _codes_at(codes: torch.Tensor, offset: int) -> torch.Tensor:
    """codes copied into a view `offset` bytes into a buffer of fill bytes."""
    buf = torch.full((codes.numel() + offset + 5,), 0xA5, dtype=torch.uint8, device=codes.device)
    view = buf[offset:offset + codes.numel()]
    view.copy_(codes)
    return view


@pytest.mark.parametrize("n", [300, 3 * 4096 + 1000])
def test_misaligned_codes_step_as_aligned_ones(device, n):
    """Codes 1 and 2 bytes off 16-byte alignment send every tile of the tensor
    down the element-wise path; aligned, its whole blocks take the vector path
    and only its last, partial block the element-wise one ([Note: full tiles
    first] in cuda/multi_tensor_apply.cuh). Two steps give the same bits, and
    the bytes around the views stay as they were."""
    g = torch.Generator().manual_seed(3)
    blocks = -(-n // BLOCK)
    params, grads = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    codes = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device) for _ in range(2)]
    maxima = [(torch.rand(blocks, generator=g) * 0.1 + 1e-3).to(device) for _ in range(2)]
    aligned = [params.clone(), grads, [c.clone() for c in codes], [m.clone() for m in maxima]]
    shifted = [params.clone(), grads, [_codes_at(c, 1 + i) for i, c in enumerate(codes)],
               [m.clone() for m in maxima]]
    assert all(c.data_ptr() % 16 for c in shifted[2])
    for step in (1, 2):
        for p, gr, (m, v), (m_max, v_max) in (aligned, shifted):
            kernels.adam([p], [gr], [m], [v], lr=1e-2, step=step, weight_decay=0.01,
                         exp_avg_absmax=[m_max], exp_avg_sq_absmax=[v_max])
    assert not torch.equal(aligned[0], params)
    assert torch.equal(shifted[0], aligned[0])
    for got, want, got_max, want_max in zip(shifted[2], aligned[2], shifted[3], aligned[3]):
        assert torch.equal(got, want) and torch.equal(got_max, want_max)
        off = got.storage_offset()
        assert bool((got._base[:off] == 0xA5).all()) and bool((got._base[off + n:] == 0xA5).all())


def test_skipped_step_writes_nothing(device):
    """GradScaler's found_inf: codes and maxima stay bit for bit."""
    model = nn.Linear(64, 48).to(device)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8, capturable=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    before = {(id(p), k): v.clone() for p in model.parameters() for k, v in opt.state[p].items()}
    params = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    plan = opt._buckets[0].prepare()
    opt._buckets[0].launch(plan, opt.rule.hyper(opt.param_groups), grad_scale=1.0,
                           found_inf=torch.ones(1, device=device))
    for p, old in zip(model.parameters(), params):
        assert torch.equal(p.detach(), old)
        for k, v in opt.state[p].items():
            assert torch.equal(v, before[(id(p), k)]), k


def test_checkpoints_hold_true_values_and_load_across_storage(device):
    """state_dict() saves fp32 values; an fp32-state optimizer loads them and
    saves the same dict; loading that back into blockwise storage gives the
    same codes and maxima (encoding a decoded value returns its code)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 48).to(device)
    opt, back = reloaded_through_fp32(model, exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8)
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.state[p][name], opt.state[p][name]), name
            assert torch.equal(back.state[p][f"{name}_absmax"], opt.state[p][f"{name}_absmax"]), name


def test_kernel_refuses_blockwise_with_scales():
    p, g = torch.zeros(300), torch.zeros(300)
    m, v = torch.zeros(300, dtype=torch.uint8), torch.zeros(300, dtype=torch.uint8)
    blocks = [torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] is blockwise 8-bit, which has block maxima, not "
                                         r"per-tensor scales"):
        kernels.AdamPlan([p], [g], [m], [v], exp_avg_absmax=[blocks[0]], exp_avg_sq_absmax=[blocks[1]],
                         exp_avg_scales=torch.ones(1))
    with pytest.raises(ValueError, match=r"max_exp_avg_sqs\[0\] has dtype uint8"):
        kernels.AdamPlan([p], [g], [m], [v], exp_avg_absmax=[blocks[0]], exp_avg_sq_absmax=[blocks[1]],
                         max_exp_avg_sqs=[torch.zeros(300, dtype=torch.uint8)])


@pytest.mark.cuda
def test_cpu_and_cuda_agree():
    """The same fp32 values encode to the same bytes on both engines; three
    optimizer steps agree within fp32 rounding (contraction of the update's
    multiply-adds differs between the compilers, so a tie may flip)."""
    g = torch.Generator().manual_seed(0)
    values = _samples(40 * BLOCK + 13, g)
    out = {}
    for device in ("cpu", "cuda"):
        codes = torch.empty(values.shape, dtype=torch.uint8, device=device)
        absmax = torch.empty(-(-values.numel() // BLOCK), device=device)
        kernels.blockwise_quantize(values.to(device), codes, absmax)
        out[device] = codes.cpu(), absmax.cpu()
    assert torch.equal(out["cpu"][0], out["cuda"][0]) and torch.equal(out["cpu"][1], out["cuda"][1])
    steps_on_cpu_and_cuda(5000, exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8)


@pytest.mark.cuda
@pytest.mark.parametrize("exp_avg_dtype", [Q8, torch.uint8], ids=["blockwise8", "fp8-exp_avg"])
def test_a_captured_step_equals_the_eager_one(exp_avg_dtype):
    """capturable=True: graph replays step the blockwise states exactly as
    eager steps, with a blockwise exp_avg or an FP8 one (scaled: two passes)
    beside the blockwise exp_avg_sq that FP8 second moments are kept in
    ([Note: FP8 second moments] in _storage.py)."""
    def make():
        p = nn.Parameter(torch.randn(3000, generator=torch.Generator().manual_seed(0)).cuda())
        p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(1)).cuda()
        return p, shardadam.FusedAdam([p], lr=1e-2, capturable=True, exp_avg_dtype=exp_avg_dtype,
                                      exp_avg_sq_dtype=torch.uint8 if exp_avg_dtype == torch.uint8 else Q8)
    (eager_p, eager), (p, opt) = captured_against_eager(make)
    assert torch.equal(p.detach(), eager_p.detach())
    for name, value in eager.state[eager_p].items():
        assert torch.equal(opt.state[p][name], value), name


# ------------------------------------------------------------ DistributedFusedAdam

WIDTH = 300  # the first layer's 300 x 16 weight: several blocks


def test_distributed_blockwise_states_are_fused_adams_where_fragments_are_whole(one_rank):
    """One rank, one bucket: every shard fragment is a whole parameter, so its
    blocks are FusedAdam's and the runs agree bit for bit."""
    dist_opt = distributed_equals_fused(dict(exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8), width=WIDTH)
    assert dist_opt.states["exp_avg"].dtype == torch.uint8 and set(dist_opt.state_blocks) == {"exp_avg", "exp_avg_sq"}


def test_distributed_blockwise_checkpoint_loads_into_other_storage(one_rank):
    """Small buckets (parameters split over fragments, blocks per fragment):
    the portable state dict holds fp32 values that an fp32-state optimizer
    loads and gives back unchanged, and blockwise storage loads back to the
    same values."""
    storage = dict(exp_avg_dtype=Q8, exp_avg_sq_dtype=Q8)
    model, opt, saved, fp32 = distributed_reloaded_through_fp32(storage, 1e-3, width=WIDTH)
    assert len(opt.state_blocks["exp_avg"]) > len(list(model.parameters()))
    back = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-3, overlap_grad_sync=False,
                                          **storage)
    back.load_state_dict(fp32.state_dict())
    for k, entry in back.state_dict()["state"].items():
        for name, value in entry.items():
            assert torch.equal(saved["state"][k][name], value), (k, name)


def test_distributed_lion_blockwise(one_rank):
    kw = dict(lr=1e-3, weight_decay=0.1, exp_avg_dtype=Q8)
    fused_model, _ = small_model_run(lambda ps: shardadam.FusedLion(ps, **kw), width=WIDTH)
    dist_model, opt = small_model_run(lambda ps: shardadam.DistributedFusedLion(
        ps, bucket_cap_mb=100, overlap_grad_sync=False, **kw), width=WIDTH)
    assert opt.states["exp_avg"].dtype == torch.uint8
    for p, q in zip(fused_model.parameters(), dist_model.parameters()):
        assert torch.equal(p, q)
