"""kernels.lion: parity with a float64 reference and with lion-pytorch's update
in float32 torch ops, dtypes (fp32 masters, bf16 remainders, scaled fp16
states), groups, tensor hyperparameters, found_inf, plans and refusals."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, assert_unchanged, randn, snapshot
from reference import FP32_U, ULP, LionHyper, assert_within, lion_step, storage_tolerance
from shardadam import _core, kernels
from test_remainders import join, split

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
SIZES = [0, 1, 7, 0, 4099]  # zero-size tensors first and in the middle
STEPS = 3


def torch_lion(p, grad, exp_avg, h: LionHyper) -> None:
    """lion-pytorch's update_fn, in place in the tensors' dtype; grad_scale and
    maximize (not lion-pytorch options) act on the gradient first."""
    grad = grad * h.grad_scale
    if h.maximize:
        grad = -grad
    p.mul_(1.0 - h.lr * h.weight_decay)
    update = exp_avg.clone().mul_(h.beta1).add(grad, alpha=1.0 - h.beta1).sign_()
    p.add_(update, alpha=-h.lr)
    exp_avg.mul_(h.beta2).add_(grad, alpha=1.0 - h.beta2)


def sign_is_sure(r) -> torch.Tensor:
    """Elements whose update is far enough from 0 that float32 arithmetic gets
    its sign right (elsewhere the param may legitimately move the other way)."""
    return r.update.abs() > 8 * FP32_U * r.update_terms


def check_step(what, p, m, p_before, grad, m_before, h: LionHyper) -> None:
    """One fp32 kernel step from (p_before, m_before) against (a) the float64
    reference within fp32 rounding and (b) lion-pytorch's float32 ops: the
    param's operations are the same ones (a multiply, then the signed step),
    so it matches bit for bit; exp_avg's multiply-add may fuse differently."""
    if p.numel() == 0:
        return
    r = lion_step(p_before, grad, m_before, h=h)
    sure = sign_is_sure(r)
    assert sure.double().mean() > 0.99, f"{what}: too many updates near 0 for the test to mean much"
    assert_within(p[sure.to(p.device)], r.param[sure], storage_tolerance(r.param, r.param_terms, F32, 4)[sure],
                  f"{what} param vs float64")
    m_tol = storage_tolerance(r.exp_avg, r.exp_avg_terms, F32, 4)
    assert_within(m, r.exp_avg, m_tol, f"{what} exp_avg vs float64")
    tp, tm = p_before.clone(), m_before.clone()
    torch_lion(tp, grad, tm, h)
    assert_bits_equal(p[sure.to(p.device)], tp[sure.to(p.device)], f"{what} param vs lion-pytorch")
    assert_within(m, tm.double().cpu(), 2 * m_tol, f"{what} exp_avg vs lion-pytorch")


# ---------------------------------------------------------------- fp32 parity

CASES = {
    "defaults": LionHyper(lr=1e-3),  # lion-pytorch's betas (0.9, 0.99)
    "weight-decay": LionHyper(lr=3e-3, weight_decay=0.1),
    "maximize": LionHyper(lr=1e-3, weight_decay=0.05, maximize=True),
    "grad-scale": LionHyper(lr=2e-3, beta1=0.95, beta2=0.98, grad_scale=2.0 ** -7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_reference_and_lion_pytorch(device, case):
    h = CASES[case]
    p = [randn(n, device=device) for n in SIZES]
    m = [randn(n, device=device, scale=0.1) for n in SIZES]
    for step in range(1, STEPS + 1):
        g = [randn(n, device=device, scale=1.0 / h.grad_scale) for n in SIZES]
        p_before, m_before = snapshot(p), snapshot(m)
        kernels.lion(p, g, m, **h.kwargs())
        for i in range(len(SIZES)):
            check_step(f"{case} step {step} [{i}]", p[i], m[i], p_before[i], g[i], m_before[i], h)


def test_zero_update_keeps_the_param_and_nan_shows(device):
    """sign(0) = 0: only the decay moves the param. A NaN gradient makes the
    param NaN (torch.sign would give 0 and leave it as if nothing happened)."""
    h = LionHyper(lr=0.25, weight_decay=0.5)
    p = torch.tensor([1.0, -2.0, -0.0, 0.5, 3.0], device=device)
    m = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0], device=device)
    g = torch.tensor([0.0, -0.0, 0.0, 1.0, float("nan")], device=device)
    tp, tm = p.clone(), m.clone()
    kernels.lion([p], [g], [m], **h.kwargs())
    torch_lion(tp, g, tm, h)
    assert_bits_equal(p[:4], tp[:4], "param")
    assert_bits_equal(m[:4], tm[:4], "exp_avg")
    assert p[:4].tolist() == [0.875, -1.75, -0.0, 0.4375 - 0.25]
    assert p[4].isnan() and m[4].isnan()


# ---------------------------------------------------------------- groups

GROUP_HYPER = dict(lr=[1e-3, 3e-2, 2e-3], beta1=[0.9, 0.8, 0.5], beta2=[0.99, 0.95, 0.999],
                   weight_decay=[0.0, 0.1, 0.01], maximize=[False, True, False])


@pytest.mark.parametrize("group_sizes", [[2, 3, 1], [3, 0, 3]], ids=["full", "middle-empty"])
def test_groups_match_reference_and_separate_calls(device, group_sizes):
    sizes = [5, 0, 300, 4099, 1, 9]
    p = [randn(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    p0, m0 = snapshot(p), snapshot(m)
    p2, m2 = snapshot(p), snapshot(m)
    kernels.lion(p, g, m, group_sizes=group_sizes, grad_scale=0.5, **GROUP_HYPER)
    start = 0
    for gi, size in enumerate(group_sizes):
        sl = slice(start, start + size)
        start += size
        h = LionHyper(grad_scale=0.5, **{k: v[gi] for k, v in GROUP_HYPER.items()})
        for i in range(sl.start, sl.stop):
            check_step(f"group {gi} [{i}]", p[i], m[i], p0[i], g[i], m0[i], h)
        if size:
            kernels.lion(p2[sl], g[sl], m2[sl], **h.kwargs())
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")


def test_more_than_32_groups(device):
    n_groups = 40
    sizes = [int(s) for s in torch.randint(1, 300, (n_groups,))]
    lrs = [1e-3 * (1 + i) for i in range(n_groups)]
    wds = [0.01 * i for i in range(n_groups)]
    p = [randn(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    p0 = snapshot(p)
    p2, m2 = snapshot(p), snapshot(m)
    kernels.lion(p, g, m, group_sizes=[1] * n_groups, lr=lrs, weight_decay=wds)
    for i in range(n_groups):
        kernels.lion(p2[i], g[i], m2[i], lr=lrs[i], weight_decay=wds[i])
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert all(not torch.equal(a, b) for a, b in zip(p, p0)), "a group past the first 32 was not updated"


# ---------------------------------------------------------------- dtypes

H_DTYPES = LionHyper(lr=1e-3, weight_decay=0.1)


def test_fp32_master_with_bf16_params_out(device):
    """fp32 masters with bf16 grads and a bf16 model copy: the masters follow
    an fp32 run bit for bit and params_out is each master rounded to bf16."""
    sizes = [7, 0, 70001]
    masters = [randn(n, device=device) for n in sizes]
    out = [torch.zeros(n, dtype=BF16, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    p32, m32 = snapshot(masters), snapshot(m)
    for step in range(STEPS):
        g = [randn(n, BF16, device) for n in sizes]
        kernels.lion(masters, g, m, params_out=out, **H_DTYPES.kwargs())
        kernels.lion(p32, [x.float() for x in g], m32, **H_DTYPES.kwargs())
        assert_all_bits_equal(masters, p32, f"step {step} masters")
        assert_all_bits_equal(m, m32, f"step {step} exp_avgs")
        assert_all_bits_equal(out, [x.to(BF16) for x in masters], f"step {step} params_out")


def test_bf16_params_with_remainders_are_the_fp32_run(device):
    sizes = [7, 0, 4099]
    masters = [randn(n, device=device) for n in sizes]
    hi, lo = map(list, zip(*(split(x) for x in masters)))
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    m32 = snapshot(m)
    for step in range(STEPS):
        g = [randn(n, BF16, device) for n in sizes]
        kernels.lion(hi, g, m, param_remainders=lo, **H_DTYPES.kwargs())
        kernels.lion(masters, [x.float() for x in g], m32, **H_DTYPES.kwargs())
        assert_all_bits_equal([join(a, b) for a, b in zip(hi, lo)], masters, f"step {step} joined masters")
        assert_all_bits_equal(m, m32, f"step {step} exp_avgs")


def sign_stable(sizes, device, scale):
    """Per element one random sign and magnitudes in [scale/2, scale): with
    gradients of the same signs the update keeps far from 0, so low-precision
    states cannot flip it."""
    signs = [torch.randint(0, 2, (n,), device=device).float() * 2 - 1 for n in sizes]

    def draw():
        return [s * (torch.rand(s.shape, device=device) * 0.5 + 0.5) * scale for s in signs]
    return draw


def test_scaled_fp16_states_track_fp32(device):
    """fp16 params under master_scales and fp16 exp_avgs under exp_avg_scales
    follow an fp32 run within fp16 rounding, at magnitudes (params ~1e-5,
    steps of 1e-7) where unscaled fp16 would be subnormal."""
    sizes = [3, 0, 3000]
    h = LionHyper(lr=1e-7, weight_decay=0.1)
    p = [randn(n, F16, device, scale=1e-5) for n in sizes]
    draw = sign_stable(sizes, device, 1e-3)
    m = [x.half() for x in draw()]
    sp, sm = torch.ones(len(sizes), device=device), torch.ones(len(sizes), device=device)
    p32, m32 = [x.float() for x in p], [x.float() for x in m]
    for step in range(1, STEPS + 1):
        g = draw()
        kernels.lion(p, g, m, master_scales=sp, exp_avg_scales=sm, **h.kwargs())
        kernels.lion(p32, g, m32, **h.kwargs())
        for scales, name in ((sp, "master_scales"), (sm, "exp_avg_scales")):
            mant, _ = torch.frexp(scales)
            assert bool((mant == 0.5).all()), f"step {step}: {name} are not powers of two: {scales}"
            assert scales[1].item() == 1.0, f"step {step}: a zero-size tensor's {name} entry must stay 1"
        for i, n in enumerate(sizes):
            if not n:
                continue
            for name, stored, scale, want in (("param", p[i], sp[i], p32[i]), ("exp_avg", m[i], sm[i], m32[i])):
                amax = stored.float().abs().max().item()
                assert 2.0 ** 14 <= amax <= 2.0 ** 15, f"step {step} {name}[{i}]: stored amax {amax}"
                tol = step * ULP[F16]
                torch.testing.assert_close(stored.float() / scale, want, rtol=tol, atol=tol * want.abs().max().item(),
                                           msg=lambda s: f"step {step} {name}[{i}]: {s}")


# ---------------------------------------------------------------- found_inf, tensors, plans

@pytest.mark.parametrize("kind", ["f32-master-scaled", "bf16-remainders"])
def test_found_inf_writes_nothing(device, kind):
    sizes = [3, 0, 70001]
    g = [randn(n, device=device) for n in sizes]
    if kind == "bf16-remainders":
        p = [randn(n, BF16, device) for n in sizes]
        m = [randn(n, device=device, scale=0.1) for n in sizes]
        extra = dict(param_remainders=[torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, device=device)
                                       for n in sizes])
    else:
        p = [randn(n, device=device) for n in sizes]
        m = [randn(n, F16, device, scale=0.1) for n in sizes]
        extra = dict(params_out=[torch.zeros(n, dtype=BF16, device=device) for n in sizes],
                     exp_avg_scales=torch.ones(len(sizes), device=device))
    written = p + m + [t for ts in extra.values() for t in (ts if isinstance(ts, list) else [ts])]
    before = snapshot(written)
    flag = torch.ones(1, device=device)
    kernels.lion(p, g, m, lr=1e-2, weight_decay=0.1, found_inf=flag, **extra)
    assert_unchanged(written, before, "found_inf=1")
    flag.zero_()
    kernels.lion(p, g, m, lr=1e-2, weight_decay=0.1, found_inf=flag, **extra)
    for i, (a, b) in enumerate(zip(written, before)):
        if a.numel():
            assert not torch.equal(a, b), f"written tensor {i} unchanged with found_inf=0"


def test_tensor_lr_and_grad_scale_equal_numbers(device):
    sizes = [7, 70001]
    p = [randn(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    p2, m2 = snapshot(p), snapshot(m)
    lr, grad_scale = 2.0 ** -10, 2.0 ** -3  # exact in float32: the tensors hold the same numbers
    kernels.lion(p, g, m, group_sizes=[1, 1], lr=[torch.tensor([lr], device=device), 3 * lr], weight_decay=0.25,
                 grad_scale=torch.tensor([grad_scale], device=device))
    kernels.lion(p2, g, m2, group_sizes=[1, 1], lr=[lr, 3 * lr], weight_decay=0.25, grad_scale=grad_scale)
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")


def test_plan_reuse_bumps_versions_and_checks_addresses(device):
    sizes = [0, 7, 70001]
    p = [randn(n, device=device) for n in sizes]
    g = [torch.zeros(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    out = [torch.zeros(n, dtype=BF16, device=device) for n in sizes]
    p2, m2, out2 = snapshot(p), snapshot(m), snapshot(out)
    plan = kernels.LionPlan(p, g, m, params_out=out)
    for step in range(STEPS):
        new_grads = [randn(n, device=device) for n in sizes]
        for dst, src in zip(g, new_grads):
            dst.copy_(src)  # the plan holds the grads' addresses
        versions = [t._version for t in p + m + out + g]
        kernels.lion(plan, lr=1e-3 / (step + 1), weight_decay=0.01)
        kernels.lion(p2, new_grads, m2, params_out=out2, lr=1e-3 / (step + 1), weight_decay=0.01)
        bumped = [t._version > v for t, v in zip(p + m + out + g, versions)]
        assert all(bumped[:3 * len(sizes)]) and not any(bumped[3 * len(sizes):]), bumped
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(out, out2, "params_out")
    m[2].data = torch.zeros_like(m[2])
    before = snapshot(p + out)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[2\] was moved"):
        kernels.lion(plan, lr=1e-3)
    assert_unchanged(p + out, before)


def test_zero_size_tensors(device):
    empty = [torch.zeros(0, device=device) for _ in range(2)]
    scales = torch.ones(2, device=device)
    kernels.lion(empty, empty, [torch.zeros(0, device=device) for _ in range(2)], lr=1e-3, exp_avg_scales=scales)
    assert scales.tolist() == [1.0, 1.0]
    kernels.lion(kernels.LionPlan([], [], [], device=device), lr=1e-3)


# ---------------------------------------------------------------- refusals

REFUSED = {
    "nan-lr": (dict(lr=float("nan")), ValueError, r"lion: lr must be finite"),
    "negative-lr": (dict(lr=-1e-3), ValueError, r"lion: lr must be >= 0"),
    "beta1-one": (dict(lr=1e-3, beta1=1.0), ValueError, r"lion: beta1 must be in \[0, 1\)"),
    "negative-beta2": (dict(lr=1e-3, beta2=-0.5), ValueError, r"lion: beta2 must be in \[0, 1\)"),
    "negative-weight-decay": (dict(lr=1e-3, weight_decay=-0.1), ValueError, r"lion: weight_decay must be >= 0"),
    "inf-weight-decay": (dict(lr=1e-3, weight_decay=float("inf")), ValueError, r"lion: weight_decay must be finite"),
    "zero-grad-scale": (dict(lr=1e-3, grad_scale=0.0), ValueError, r"lion: grad_scale must be > 0"),
    "tensor-beta1": (dict(lr=1e-3, beta1=torch.tensor(0.9)), TypeError, r"lion: beta1 must be a Python number"),
    "second-group": (dict(lr=[1e-3, float("nan")]), ValueError, r"lion: lr\[1\] must be finite"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_name_the_argument_and_write_nothing(device, case):
    kwargs, exc, message = REFUSED[case]
    p = [randn(n, device=device) for n in (5, 9)]
    m = [randn(n, device=device, scale=0.1) for n in (5, 9)]
    g = [randn(n, device=device) for n in (5, 9)]
    before = snapshot(p + m)
    plan = kernels.LionPlan(p, g, m, group_sizes=[1, 1])
    with pytest.raises(exc, match=message):
        kernels.lion(plan, **kwargs)
    assert_unchanged(p + m, before)


def test_second_moments_are_refused(device):
    p, g, m, v = ([randn(5, device=device)] for _ in range(4))
    before = snapshot(p + m + v)
    with pytest.raises(TypeError, match="exp_avg_sqs"):
        kernels.LionPlan(p, g, m, exp_avg_sqs=v)
    with pytest.raises(TypeError, match="exp_avg_sqs"):
        kernels.lion(p, g, m, lr=1e-3, exp_avg_sqs=v)
    with pytest.raises(TypeError, match="max_exp_avg_sqs"):
        kernels.lion(p, g, m, lr=1e-3, max_exp_avg_sqs=v)
    with pytest.raises(TypeError, match="exp_avg_sq_scales"):
        kernels.LionPlan(p, g, m, exp_avg_sq_scales=torch.ones(1, device=device))
    with pytest.raises(ValueError, match="lion: exp_avgs must be given"):
        kernels.lion(p, g, lr=1e-3)
    # The core refuses them too: a table that holds them, scales for them.
    adam_plan = kernels.AdamPlan(p, g, m, v)
    with pytest.raises(ValueError, match="lion: exp_avg_sqs must not be given"):
        _core.check_lion_table(adam_plan.table, False)
    plan = kernels.LionPlan(p, g, m)
    scales, scratch = torch.ones(1, device=device), torch.zeros(3, device=device)
    extras = _core.AdamExtras()
    extras.scales = (0, 0, scales.data_ptr())
    extras.amax_scratch = scratch.data_ptr()
    group = _core.AdamGroup()
    group.lr = _core.Scalar(1e-3)
    with pytest.raises(ValueError, match="lion: exp_avg_sq_scales given for a state lion does not keep"):
        _core.lion(plan.table, [group], extras, *plan.target())
    assert_unchanged(p + m + v, before)
