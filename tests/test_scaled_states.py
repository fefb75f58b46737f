"""Low-precision states kept as value * scale with per-tensor power-of-two scales."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, rand_pos, randn, snapshot
from reference import FP32_U, TINY, ULP, AdamHyper, adam_step, assert_within
from shardadam import kernels

F16, BF16 = torch.float16, torch.bfloat16
B1, B2 = 0.875, 1.0 - 2.0 ** -10
STEPS = 10


def assert_pow2(scales: torch.Tensor, what: str) -> None:
    mant, _ = torch.frexp(scales.cpu())
    assert bool((scales > 0).all()) and bool((mant == 0.5).all()), f"{what} are not powers of two: {scales}"


def assert_stored_amax_near_2_15(stored: torch.Tensor, what: str) -> None:
    """The kernel maps each tensor's absolute maximum just under 2^15."""
    amax = stored.float().abs().max().item()
    assert 2.0 ** 14 <= amax <= 2.0 ** 15, f"{what}: stored amax {amax} not in [2^14, 2^15]"


def run_states(params0, grads, state_dtype, scaled: bool, lr=1e-2, check=None):
    device = params0[0].device
    n = len(params0)
    p = snapshot(params0)
    m = [torch.zeros_like(x, dtype=state_dtype) for x in p]
    v = [torch.zeros_like(x, dtype=state_dtype) for x in p]
    sm = torch.ones(n, device=device) if scaled else None
    sv = torch.ones(n, device=device) if scaled else None
    for step, gs in enumerate(grads, 1):
        kernels.adam(p, gs, m, v, lr=lr, step=step, beta1=B1, beta2=B2, weight_decay=0.01,
                     exp_avg_scales=sm, exp_avg_sq_scales=sv)
        if check is not None:
            check(step, p, m, v, sm, sv)
    return p, m, v, sm, sv


def true_values(stored, scales):
    return [t.float() / (scales[i] if scales is not None else 1.0) for i, t in enumerate(stored)]


@pytest.mark.parametrize("state_dtype", [F16, BF16], ids=["f16", "bf16"])
def test_scaled_states_track_fp32_states(device, state_dtype):
    sizes = [3, 0, 5000, 70001]
    params0 = [randn(n, device=device) for n in sizes]
    grads = [[randn(n, device=device, scale=0.01) for n in sizes] for _ in range(STEPS)]
    ref = {}

    def record(step, p, m, v, sm, sv):
        ref[step] = snapshot(p + m + v)

    p_a, m_a, v_a, _, _ = run_states(params0, grads, torch.float32, scaled=False, check=record)
    eps = ULP[state_dtype]

    def check(step, p, m, v, sm, sv):
        want = ref[step]
        k = len(sizes)
        assert_pow2(sm, "exp_avg_scales")
        assert_pow2(sv, "exp_avg_sq_scales")
        assert sm[1].item() == 1.0 and sv[1].item() == 1.0, "a zero-size tensor's scale must stay 1"
        tm, tv = true_values(m, sm), true_values(v, sv)
        for i, n in enumerate(sizes):
            if not n:
                continue
            assert_stored_amax_near_2_15(m[i], f"step {step} exp_avg[{i}]")
            assert_stored_amax_near_2_15(v[i], f"step {step} exp_avg_sq[{i}]")
            for name, got, exp in (("exp_avg", tm[i], want[k + i]), ("exp_avg_sq", tv[i], want[2 * k + i])):
                mag = exp.abs().max().item()
                torch.testing.assert_close(got, exp, rtol=4 * eps, atol=4 * eps * mag,
                                           msg=lambda s: f"step {step} {name}[{i}]: {s}")
            moved = want[i] - params0[i]
            torch.testing.assert_close(p[i] - params0[i], moved, rtol=0, atol=4 * eps * moved.abs().max().item(),
                                       msg=lambda s: f"step {step} param[{i}] update: {s}")

    _, _, _, sm, sv = run_states(params0, grads, state_dtype, scaled=True, check=check)
    # Scales moved far from their starting value of 1 (states are ~1e-3 and 1e-4).
    assert sm[2].item() >= 2.0 ** 20 and sv[2].item() >= 2.0 ** 25


def test_tiny_gradients_need_scales(device):
    """Gradients of 1e-6: exp_avg_sq (~1e-15) underflows fp16 unscaled, and the
    update blows up; with scales the fp16 run tracks the fp32 run."""
    sizes = [5000]
    params0 = [randn(n, device=device) for n in sizes]
    grads = [[randn(n, device=device, scale=1e-6) for n in sizes] for _ in range(STEPS)]
    lr = 1e-3
    p32, m32, v32, _, _ = run_states(params0, grads, torch.float32, scaled=False, lr=lr)
    p_un, _, v_un, _, _ = run_states(params0, grads, F16, scaled=False, lr=lr)
    p_sc, m_sc, v_sc, sm, sv = run_states(params0, grads, F16, scaled=True, lr=lr)
    upd32 = p32[0] - params0[0]
    tol = dict(rtol=0, atol=16 * ULP[F16] * upd32.abs().max().item())
    torch.testing.assert_close(p_sc[0] - params0[0], upd32, **tol)
    torch.testing.assert_close(true_values(v_sc, sv)[0], v32[0], rtol=8 * ULP[F16],
                               atol=8 * ULP[F16] * v32[0].abs().max().item())
    torch.testing.assert_close(true_values(m_sc, sm)[0], m32[0], rtol=8 * ULP[F16],
                               atol=8 * ULP[F16] * m32[0].abs().max().item())
    # Unscaled fp16: exp_avg_sq underflowed to zero and the params ran away.
    assert bool((v_un[0] == 0).all())
    err_un = ((p_un[0] - params0[0]) - upd32).abs().max().item()
    assert err_un > 100 * tol["atol"], f"unscaled fp16 states unexpectedly tracked fp32 (error {err_un})"


def test_master_scales_with_fp16_params(device):
    """fp16 params stored scaled: each step matches a float64 step from the
    decoded values within fp16 rounding, where unscaled fp16 (subnormal at
    these magnitudes) does not."""
    sizes = [7, 0, 4099]
    h = AdamHyper(lr=1e-7, beta1=B1, beta2=B2, eps=1e-8, weight_decay=0.0)
    masters = [randn(n, device=device, scale=1e-5) for n in sizes]

    def run(scaled: bool):
        p = [x.to(F16) for x in masters]
        m = [randn(n, device=device, scale=1e-3) for n in sizes]
        v = [rand_pos(n, device=device) for n in sizes]
        out = [torch.zeros(n, device=device) for n in sizes]
        scales = torch.ones(len(sizes), device=device) if scaled else None
        worst = 0.0
        for step in range(1, 6):
            g = [randn(n, device=device) for n in sizes]
            s_old = scales.clone() if scaled else torch.ones(len(sizes))
            decoded = [p[i].float() / s_old[i].item() for i in range(len(sizes))]
            refs = [adam_step(decoded[i], g[i], m[i], v[i], step=step, h=h) for i in range(len(sizes))]
            kernels.adam(p, g, m, v, params_out=out, master_scales=scales, step=step, **{
                k: val for k, val in h.kwargs().items()})
            s_new = scales if scaled else torch.ones(len(sizes), device=device)
            if scaled:
                assert_pow2(scales, "master_scales")
            for i, r in enumerate(refs):
                if not sizes[i]:
                    continue
                got = p[i].float() / s_new[i]
                # fp16's relative precision, whatever the magnitude.
                tol = ULP[F16] * r.param.abs() + 16 * FP32_U * r.param_terms
                err = ((got.double().cpu() - r.param) / tol).abs().max().item()
                worst = max(worst, err)
                if scaled:
                    assert_within(got, r.param, tol + TINY[F16] / s_new[i].item(), f"step {step} param[{i}]")
                    assert_stored_amax_near_2_15(p[i], f"step {step} param[{i}]")
                    # params_out holds the true fp32 master, before scaling and rounding.
                    assert_within(out[i], r.param, ULP[torch.float32] * r.param.abs() + 16 * FP32_U * r.param_terms,
                                  f"step {step} params_out[{i}]")
                    torch.testing.assert_close(got, out[i], rtol=ULP[F16], atol=0)
        return worst

    run(scaled=True)
    assert run(scaled=False) > 1.0, "unscaled fp16 params unexpectedly within fp16 tolerance: test too weak"


def test_found_inf_leaves_scales_untouched(device):
    sizes = [9, 70001]
    p = [randn(n, F16, device) for n in sizes]
    m = [torch.zeros(n, dtype=F16, device=device) for n in sizes]
    v = [torch.zeros(n, dtype=BF16, device=device) for n in sizes]
    scales = [torch.ones(len(sizes), device=device) for _ in range(3)]
    kw = dict(master_scales=scales[0], exp_avg_scales=scales[1], exp_avg_sq_scales=scales[2], lr=1e-3)
    kernels.adam(p, [randn(n, device=device) for n in sizes], m, v, step=1, **kw)
    assert all(bool((s != 1).all()) for s in scales), "the first step should have set new scales"
    before = snapshot(p + m + v + scales)
    flag = torch.ones(1, device=device)
    kernels.adam(p, [randn(n, device=device) * 1e3 for n in sizes], m, v, step=2, found_inf=flag, **kw)
    assert_all_bits_equal(p + m + v + scales, before, "found_inf=1")
    flag.zero_()
    kernels.adam(p, [randn(n, device=device) * 1e3 for n in sizes], m, v, step=2, found_inf=flag, **kw)
    assert not all(torch.equal(a, b) for a, b in zip(scales, before[-3:]))


def test_scaled_states_over_many_groups_equal_separate_calls(device):
    """Scales are per tensor: one call over 34 groups equals 34 single-tensor calls."""
    n_groups = 34
    sizes = [int(s) for s in torch.randint(1, 200, (n_groups,))]
    sizes[33] = 70001
    lrs = [1e-3 * (i + 1) for i in range(n_groups)]
    p = [randn(n, device=device) for n in sizes]
    m = [randn(n, F16, device, 0.1) for n in sizes]
    v = [rand_pos(n, F16, device) for n in sizes]
    sm = torch.ones(n_groups, device=device)
    sv = torch.ones(n_groups, device=device)
    p2, m2, v2, sm2, sv2 = snapshot(p), snapshot(m), snapshot(v), sm.clone(), sv.clone()
    for step in (1, 2):
        g = [randn(n, device=device) for n in sizes]
        kernels.adam(p, g, m, v, group_sizes=[1] * n_groups, lr=lrs, step=step, exp_avg_scales=sm,
                     exp_avg_sq_scales=sv)
        for i in range(n_groups):
            one_m, one_v = sm2[i:i + 1].clone(), sv2[i:i + 1].clone()
            kernels.adam(p2[i], g[i], m2[i], v2[i], lr=lrs[i], step=step, exp_avg_scales=one_m,
                         exp_avg_sq_scales=one_v)
            sm2[i], sv2[i] = one_m[0], one_v[0]
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(v, v2, "exp_avg_sqs")
    assert_bits_equal(sm, sm2, "exp_avg_scales")
    assert_bits_equal(sv, sv2, "exp_avg_sq_scales")
