"""kernels.adam: parity with torch.optim and a float64 reference, dtypes, layouts,
groups, plans and found_inf."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_bits_equal, assert_bits_equal, rand_pos, randn, snapshot
from reference import AdamHyper, adam_step, adam_steps, assert_within, storage_tolerance
from shardadam import kernels

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Betas exactly representable in float32, so that 1 - beta is the same number
# whether it is computed in float32 or float64.
EXACT_BETAS = (0.875, 1.0 - 2.0 ** -10)
SIZES = [0, 1, 7, 0, 278011, 0]  # odd sizes, zero-size tensors first, in the middle and last
STEPS = 10


def close(actual, expected, what="", rtol=1e-6, magnitude=None):
    """fp32 parity: rtol 1e-6 elementwise, and 1e-6 of the magnitude (by default
    the tensor's largest value; compare_runs passes the whole list's) absolute."""
    assert actual.shape == expected.shape, what
    if expected.numel() == 0:
        return
    if magnitude is None:
        magnitude = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * magnitude, msg=lambda m: f"{what}: {m}")


def grads_seq(sizes, device, steps=STEPS, decay=None, dtype=F32):
    """Fresh gradients per step; with `decay`, step s is scaled by decay**s (makes v shrink)."""
    out = []
    for s in range(steps):
        scale = 1.0 if decay is None else decay ** s
        out.append([randn(n, dtype, device, scale) for n in sizes])
    return out


def torch_run(opt_cls, params0, grads, **opt_kwargs):
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = opt_cls(ps, foreach=False, **opt_kwargs)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    st = [opt.state[p] for p in ps]
    out = {"params": [p.detach() for p in ps], "exp_avgs": [s["exp_avg"] for s in st],
           "exp_avg_sqs": [s["exp_avg_sq"] for s in st]}
    if opt_kwargs.get("amsgrad"):
        out["max_exp_avg_sqs"] = [s["max_exp_avg_sq"] for s in st]
    return out


def kernel_run(params0, grads, amsgrad=False, **kw):
    p = [x.clone() for x in params0]
    m = [torch.zeros_like(x) for x in params0]
    v = [torch.zeros_like(x) for x in params0]
    vmax = [torch.zeros_like(x) for x in params0] if amsgrad else None
    for s, gs in enumerate(grads, 1):
        kernels.adam(p, gs, m, v, max_exp_avg_sqs=vmax, step=s, **kw)
    out = {"params": p, "exp_avgs": m, "exp_avg_sqs": v}
    if amsgrad:
        out["max_exp_avg_sqs"] = vmax
    return out


def compare_runs(got, want):
    assert set(got) == set(want)
    for key in want:
        magnitude = max(e.abs().max().item() for e in want[key] if e.numel())
        for i, (a, e) in enumerate(zip(got[key], want[key])):
            close(a, e, f"{key}[{i}]", magnitude=magnitude)


# ---------------------------------------------------------------- torch parity

B1, B2 = EXACT_BETAS
TORCH_CASES = {
    "adamw": (torch.optim.AdamW, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05),
              dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05)),
    "adam-l2": (torch.optim.Adam, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05),
                dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05, adam_w_mode=False)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05, amsgrad=True),
                      dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05, amsgrad=True)),
    "adam-l2-amsgrad": (torch.optim.Adam, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05, amsgrad=True),
                        dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05, adam_w_mode=False, amsgrad=True)),
    "adamw-maximize": (torch.optim.AdamW, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05, maximize=True),
                       dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05, maximize=True)),
    "adam-l2-maximize": (torch.optim.Adam, dict(lr=2e-3, betas=EXACT_BETAS, weight_decay=0.05, maximize=True),
                         dict(lr=2e-3, beta1=B1, beta2=B2, weight_decay=0.05, adam_w_mode=False,
                              maximize=True)),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_optim(device, case):
    opt_cls, torch_kw, kernel_kw = TORCH_CASES[case]
    params0 = [randn(n, device=device) for n in SIZES]
    # Shrinking gradients make exp_avg_sq fall, so AMSGrad's maximum matters.
    grads = grads_seq(SIZES, device, decay=0.5 if "amsgrad" in case else None)
    want = torch_run(opt_cls, params0, grads, **torch_kw)
    got = kernel_run(params0, grads, **kernel_kw)
    compare_runs(got, want)
    if "amsgrad" in case:
        vmax, v = got["max_exp_avg_sqs"][4], got["exp_avg_sqs"][4]
        assert (vmax > v).float().mean() > 0.25, "AMSGrad maximum never exceeded exp_avg_sq: the case tests nothing"


def test_default_betas_match_torch(device):
    """torch.optim's defaults, betas (0.9, 0.999): states and params at fp32 parity."""
    params0 = [randn(n, device=device) for n in SIZES]
    grads = grads_seq(SIZES, device)
    want = torch_run(torch.optim.AdamW, params0, grads, lr=1e-3, weight_decay=0.01)
    got = kernel_run(params0, grads, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    compare_runs(got, want)


def test_nonfinite_param_leaves_states_like_torch(device):
    """AdamW: a param that is inf or NaN does not enter the moments (decay is decoupled)."""
    p0 = randn(64, device=device)
    p0[3] = float("inf")
    p0[9] = float("-inf")
    p0[17] = float("nan")
    grads = grads_seq([64], device, steps=3)
    want = torch_run(torch.optim.AdamW, [p0], grads, lr=1e-3, betas=EXACT_BETAS, weight_decay=0.01)
    got = kernel_run([p0], grads, lr=1e-3, beta1=B1, beta2=B2, weight_decay=0.01)
    torch.testing.assert_close(got["params"][0], want["params"][0], rtol=1e-6, atol=1e-6, equal_nan=True)
    close(got["exp_avgs"][0], want["exp_avgs"][0], "exp_avg")
    close(got["exp_avg_sqs"][0], want["exp_avg_sqs"][0], "exp_avg_sq")


# ---------------------------------------------------------------- float64 reference

@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
def test_no_bias_correction_matches_reference(device, adam_w_mode, amsgrad):
    sizes = [7, 0, 5000]
    h = AdamHyper(lr=1e-3, beta1=B1, beta2=B2, eps=1e-8, weight_decay=0.02, adam_w_mode=adam_w_mode,
                  bias_correction=False)
    params0 = [randn(n, device=device) for n in sizes]
    m0 = [randn(n, device=device, scale=0.1) for n in sizes]
    v0 = [rand_pos(n, device=device) for n in sizes]
    vmax0 = [x * 1.5 for x in v0] if amsgrad else None
    grads = grads_seq(sizes, device)
    p, m, v = snapshot(params0), snapshot(m0), snapshot(v0)
    vmax = snapshot(vmax0) if amsgrad else None
    # step=0 is allowed without bias correction, and must not matter.
    for s, gs in enumerate(grads):
        kernels.adam(p, gs, m, v, max_exp_avg_sqs=vmax, step=s, **h.kwargs())
    for i in range(len(sizes)):
        ref = adam_steps(params0[i], [gs[i] for gs in grads], m0[i], v0[i],
                         vmax0[i] if amsgrad else None, h=h)
        close(p[i].double().cpu(), ref.param.view(p[i].shape), f"param[{i}]")
        close(m[i].double().cpu(), ref.exp_avg.view(p[i].shape), f"exp_avg[{i}]")
        close(v[i].double().cpu(), ref.exp_avg_sq.view(p[i].shape), f"exp_avg_sq[{i}]")
        if amsgrad:
            close(vmax[i].double().cpu(), ref.max_exp_avg_sq.view(p[i].shape), f"max_exp_avg_sq[{i}]")


@pytest.mark.parametrize("grad_scale,maximize", [(0.3, False), (2.0 ** -12, False), (5.0, True)])
def test_grad_scale_matches_reference(device, grad_scale, maximize):
    sizes = [1, 3001]
    h = AdamHyper(lr=1e-2, beta1=B1, beta2=B2, eps=1e-6, weight_decay=0.1, adam_w_mode=False,
                  maximize=maximize, grad_scale=grad_scale)
    params0 = [randn(n, device=device) for n in sizes]
    grads = grads_seq(sizes, device, steps=4)
    got = kernel_run(params0, grads, **h.kwargs())
    for i in range(len(sizes)):
        ref = adam_steps(params0[i], [gs[i] for gs in grads], torch.zeros(sizes[i]), torch.zeros(sizes[i]), h=h)
        close(got["params"][i].double().cpu(), ref.param, f"param[{i}]")
        close(got["exp_avgs"][i].double().cpu(), ref.exp_avg, f"exp_avg[{i}]")
        close(got["exp_avg_sqs"][i].double().cpu(), ref.exp_avg_sq, f"exp_avg_sq[{i}]")


def test_grad_scale_undoes_loss_scaling_exactly(device):
    """grads * 2^k with grad_scale 2^-k is the same computation bit for bit."""
    sizes = [5, 1000]
    params0 = [randn(n, device=device) for n in sizes]
    grads = grads_seq(sizes, device, steps=3)
    scaled = [[g * 2.0 ** 12 for g in gs] for gs in grads]
    a = kernel_run(params0, grads, lr=1e-3, weight_decay=0.01)
    b = kernel_run(params0, scaled, lr=1e-3, weight_decay=0.01, grad_scale=2.0 ** -12)
    for key in a:
        assert_all_bits_equal(b[key], a[key], key)


SCALAR_CASES = {
    "lr-f64": dict(lr=lambda d: torch.tensor(1e-3, dtype=torch.float64, device=d)),
    "lr-f32": dict(lr=lambda d: torch.tensor([2.0 ** -10], dtype=torch.float32, device=d)),
    "step-i64": dict(step=lambda d, s: torch.tensor(s, dtype=torch.int64, device=d)),
    "step-i32": dict(step=lambda d, s: torch.tensor([s], dtype=torch.int32, device=d)),
    "step-f32": dict(step=lambda d, s: torch.tensor(float(s), dtype=torch.float32, device=d)),
    "gs-f64": dict(grad_scale=lambda d: torch.tensor(0.3, dtype=torch.float64, device=d)),
    "gs-f32": dict(grad_scale=lambda d: torch.tensor(0.5, dtype=torch.float32, device=d)),
    "all": dict(lr=lambda d: torch.tensor(1e-3, dtype=torch.float64, device=d),
                step=lambda d, s: torch.tensor(s, dtype=torch.int64, device=d),
                grad_scale=lambda d: torch.tensor(0.3, dtype=torch.float64, device=d)),
}
SCALAR_NUMBERS = {"lr-f64": 1e-3, "lr-f32": 2.0 ** -10, "gs-f64": 0.3, "gs-f32": 0.5}


@pytest.mark.parametrize("case", list(SCALAR_CASES))
def test_tensor_scalars_equal_numbers(device, case):
    sizes = [3, 0, 2049]
    params0 = [randn(n, device=device) for n in sizes]
    grads = grads_seq(sizes, device, steps=3)
    spec = SCALAR_CASES[case]
    lr_num = SCALAR_NUMBERS.get(case, 1e-3)
    gs_num = SCALAR_NUMBERS.get(case, 0.3) if case.startswith("gs") or case == "all" else 1.0

    def run(use_tensors):
        p = snapshot(params0)
        m = [torch.zeros_like(x) for x in p]
        v = [torch.zeros_like(x) for x in p]
        for s, gs in enumerate(grads, 1):
            kw = dict(lr=lr_num, step=s, grad_scale=gs_num)
            if use_tensors:
                for name, make in spec.items():
                    kw[name] = make(device, s) if name == "step" else make(device)
            kernels.adam(p, gs, m, v, weight_decay=0.01, **kw)
        return p + m + v

    assert_all_bits_equal(run(True), run(False), case)


def test_cpu_scalar_tensor_for_any_device(device):
    """A CPU one-element tensor is accepted as a number on any device."""
    params0 = [randn(100, device=device)]
    grads = grads_seq([100], device, steps=1)
    a = kernel_run(params0, grads, lr=torch.tensor(1e-3, dtype=torch.float64), weight_decay=0.01)
    b = kernel_run(params0, grads, lr=1e-3, weight_decay=0.01)
    for key in a:
        assert_all_bits_equal(a[key], b[key], key)


@pytest.mark.cuda
def test_gpu_scalar_tensor_for_cpu_tensors():
    """A GPU one-element tensor for CPU tensors (state in host memory with a
    GPU lr) is read when called, as a number."""
    params0 = [randn(100, device="cpu")]
    grads = grads_seq([100], "cpu", steps=2)
    a = kernel_run(params0, grads, lr=torch.tensor(1e-3, device="cuda"), grad_scale=torch.tensor(0.5, device="cuda"),
                   weight_decay=0.01)
    b = kernel_run(params0, grads, lr=float(torch.tensor(1e-3)), grad_scale=0.5, weight_decay=0.01)
    for key in a:
        assert_all_bits_equal(a[key], b[key], key)


# ---------------------------------------------------------------- dtypes

DTYPES = [F32, F16, BF16]
DNAME = {F32: "f32", F16: "f16", BF16: "bf16"}


# With and without AMSGrad: the GPU runs tables of common dtype mixes through
# kernels compiled for fixed dtypes and all others through a general kernel.
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("state_dtype", DTYPES, ids=lambda d: "state_" + DNAME[d])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: "grad_" + DNAME[d])
@pytest.mark.parametrize("param_dtype", DTYPES, ids=lambda d: "param_" + DNAME[d])
def test_dtype_combinations_match_reference(device, param_dtype, grad_dtype, state_dtype, amsgrad):
    sizes = [5, 4099]
    h = AdamHyper(lr=0.1, beta1=B1, beta2=B2, eps=1e-8, weight_decay=0.1)
    p = [randn(n, param_dtype, device) for n in sizes]
    m = [randn(n, state_dtype, device, 0.1) for n in sizes]
    v = [rand_pos(n, state_dtype, device) for n in sizes]
    vmax = [(x.float() * (0.5 + torch.rand(x.shape, device=device))).to(state_dtype) for x in v]
    for step in (1, 2, 3):
        g = [randn(n, grad_dtype, device) for n in sizes]
        # The reference starts from exactly the values stored now.
        refs = [adam_step(p[i], g[i], m[i], v[i], vmax[i] if amsgrad else None, step=step, h=h)
                for i in range(len(sizes))]
        p_old = snapshot(p)
        kernels.adam(p, g, m, v, max_exp_avg_sqs=vmax if amsgrad else None, step=step, **h.kwargs())
        # The test can fail: most updates are well beyond the tolerance.
        moved = torch.cat([(r.param - p_old[i].double().cpu().reshape(-1)).abs()
                           > 2 * storage_tolerance(r.param, r.param_terms, param_dtype) for i, r in enumerate(refs)])
        assert moved.float().mean() > 0.6, "updates smaller than the tolerance: the case tests nothing"
        for i, r in enumerate(refs):
            assert p[i].dtype == param_dtype and m[i].dtype == state_dtype and v[i].dtype == state_dtype
            tol_p = storage_tolerance(r.param, r.param_terms, param_dtype)
            assert_within(p[i], r.param, tol_p, f"step {step} param[{i}]")
            assert_within(m[i], r.exp_avg, storage_tolerance(r.exp_avg, r.exp_avg_terms, state_dtype),
                          f"step {step} exp_avg[{i}]")
            assert_within(v[i], r.exp_avg_sq, storage_tolerance(r.exp_avg_sq, r.exp_avg_sq_terms, state_dtype),
                          f"step {step} exp_avg_sq[{i}]")
            if amsgrad:
                assert_within(vmax[i], r.max_exp_avg_sq,
                              storage_tolerance(r.max_exp_avg_sq, r.exp_avg_sq_terms, state_dtype),
                              f"step {step} max_exp_avg_sq[{i}]")


@pytest.mark.parametrize("grad_is_low", [False, True], ids=["grad_f32", "grad_low"])
@pytest.mark.parametrize("out_dtype", [BF16, F16], ids=["bf16", "f16"])
def test_params_out_is_master_rounded(device, out_dtype, grad_is_low):
    sizes = [1, 0, 9, 70001]
    # Magnitudes from fp16-subnormal to past fp16's range, so rounding,
    # subnormals and overflow to inf are all exercised.
    p = [(randn(n) * 10.0 ** (torch.rand(n) * 13 - 8)).to(device) for n in sizes]
    m = [randn(n, device=device, scale=1e-3) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    out = [torch.full((n,), 7.0, dtype=out_dtype, device=device) for n in sizes]
    for step in (1, 2, 3):
        g = [randn(n, out_dtype if grad_is_low else F32, device) for n in sizes]
        kernels.adam(p, g, m, v, params_out=out, lr=1e-3, step=step, weight_decay=0.01)
        for i in range(len(sizes)):
            assert_bits_equal(out[i], p[i].to(out_dtype), f"step {step} params_out[{i}]")
    if out_dtype == F16:  # the data did reach fp16's overflow and subnormal ranges
        assert bool(torch.isinf(out[3]).any())
        assert bool(((out[3].abs() < 2.0 ** -14) & (out[3] != 0)).any())


def test_many_small_tensors_equal_per_tensor_calls(device):
    n_tensors = 3000
    sizes = torch.randint(0, 40, (n_tensors,)).tolist()
    p = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    p0 = snapshot(p)
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    kw = dict(lr=1e-3, step=4, weight_decay=0.01)
    kernels.adam(p, g, m, v, **kw)
    for i in range(n_tensors):
        kernels.adam(p2[i], g[i], m2[i], v2[i], **kw)
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(v, v2, "exp_avg_sqs")
    assert all(not torch.equal(a, b) for a, b in zip(p, p0) if a.numel())


def _offset_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    buf = torch.full((t.numel() + offset + 3,), 123.0, dtype=t.dtype, device=t.device) \
        if t.dtype != torch.int16 else torch.full((t.numel() + offset + 3,), 77, dtype=t.dtype, device=t.device)
    view = buf[offset:offset + t.numel()]
    view.copy_(t)
    return view


@pytest.mark.parametrize("remainders", [False, True], ids=["f32-master", "bf16-remainders"])
@pytest.mark.parametrize("n", [1, 7, 4099, 70001])
def test_misaligned_views_match_aligned(device, n, remainders):
    if remainders:
        master = randn(n, device=device)
        hi, lo = torch.empty(n, dtype=BF16, device=device), torch.empty(n, dtype=torch.int16, device=device)
        u = master.view(torch.int32)
        lo.copy_((u & 0xFFFF).to(torch.int16))
        hi.view(torch.int16).copy_((((u >> 16) + ((u >> 15) & 1)) & 0xFFFF).to(torch.int16))
        lists = dict(params=hi, param_remainders=lo)
    else:
        lists = dict(params=randn(n, device=device), params_out=torch.zeros(n, dtype=BF16, device=device))
    lists.update(grads=randn(n, BF16, device), exp_avgs=randn(n, device=device, scale=0.1),
                 exp_avg_sqs=rand_pos(n, device=device),
                 max_exp_avg_sqs=rand_pos(n, device=device, low=1e-7, high=1e-6))
    aligned = {k: t.clone() for k, t in lists.items()}
    misaligned = {k: _offset_view(t, 1 + i % 3) for i, (k, t) in enumerate(lists.items())}
    assert any(t.data_ptr() % 16 for t in misaligned.values())
    for step in (1, 2):
        for d in (aligned, misaligned):
            kernels.adam(d["params"], d["grads"], d["exp_avgs"], d["exp_avg_sqs"], lr=1e-3, step=step,
                         weight_decay=0.01,
                         **{k: d[k] for k in ("max_exp_avg_sqs", "params_out", "param_remainders") if k in d})
    for k in lists:
        assert_bits_equal(misaligned[k], aligned[k], k)
        if k != "grads" and not (remainders and k == "params"):  # a bf16 high half may not move
            assert not torch.equal(aligned[k], lists[k]), f"{k} was not updated"
    # Neighbours of the views are untouched.
    for k, t in misaligned.items():
        base = t._base
        off = t.storage_offset()
        fill = 77 if t.dtype == torch.int16 else 123.0
        assert bool((base[:off] == fill).all()) and bool((base[off + n:] == fill).all()), k


# ---------------------------------------------------------------- found_inf

@pytest.mark.parametrize("remainders", [False, True], ids=["f32-master", "bf16-remainders"])
def test_found_inf_writes_nothing(device, remainders):
    sizes = [3, 0, 70001]
    if remainders:
        p = [randn(n, BF16, device) for n in sizes]
        extra = dict(param_remainders=[torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, device=device)
                                       for n in sizes])
    else:
        p = [randn(n, device=device) for n in sizes]
        extra = dict(params_out=[torch.zeros(n, dtype=F16, device=device) for n in sizes])
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    extra["max_exp_avg_sqs"] = [rand_pos(n, device=device) for n in sizes]
    everything = p + m + v + [t for ts in extra.values() for t in ts]
    before = snapshot(everything)
    flag = torch.ones(1, device=device)
    kernels.adam(p, g, m, v, lr=1e-2, step=3, weight_decay=0.1, found_inf=flag, **extra)
    assert_all_bits_equal(everything, before, "found_inf=1")
    assert flag.item() == 1.0
    flag.fill_(float("inf"))
    kernels.adam(p, g, m, v, lr=1e-2, step=3, weight_decay=0.1, found_inf=flag, **extra)
    assert_all_bits_equal(everything, before, "found_inf=inf")
    # Control: with the flag clear, the same call writes every list.
    flag.zero_()
    kernels.adam(p, g, m, v, lr=1e-2, step=3, weight_decay=0.1, found_inf=flag, **extra)
    for i, (a, b) in enumerate(zip(everything, before)):
        if a.numel():
            assert not torch.equal(a, b), f"list entry {i} unchanged with found_inf=0"


# ---------------------------------------------------------------- groups and plans

GROUP_HYPER = dict(lr=[1e-3, 3e-2, 2e-3], beta1=[0.9, 0.8, 0.5], beta2=[0.999, 0.99, 0.95],
                   eps=[1e-8, 1e-6, 1e-3], weight_decay=[0.0, 0.1, 0.01], adam_w_mode=[True, False, True],
                   bias_correction=[True, True, False], maximize=[False, True, False], step=[3, 5, 1])


@pytest.mark.parametrize("group_sizes", [[2, 3, 1], [0, 3, 2], [3, 0, 2], [3, 2, 0]],
                         ids=["full", "leading-empty", "middle-empty", "trailing-empty"])
def test_groups_equal_separate_calls(device, group_sizes):
    n_t = sum(group_sizes)
    sizes = [5, 0, 300, 70001, 1, 9][:n_t]
    p = [randn(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    kernels.adam(p, g, m, v, group_sizes=group_sizes, grad_scale=0.5, **GROUP_HYPER)
    start = 0
    for gi, size in enumerate(group_sizes):
        sl = slice(start, start + size)
        start += size
        if size == 0:
            continue
        kernels.adam(p2[sl], g[sl], m2[sl], v2[sl], grad_scale=0.5, **{k: val[gi] for k, val in GROUP_HYPER.items()})
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(v, v2, "exp_avg_sqs")


def test_more_than_32_groups(device):
    n_groups = 40
    sizes = [int(s) for s in torch.randint(1, 300, (n_groups,))]
    sizes[5] = 70001  # a multi-chunk tensor inside
    lrs = [1e-3 * (1 + i) for i in range(n_groups)]
    wds = [0.001 * i for i in range(n_groups)]
    p = [randn(n, device=device) for n in sizes]
    g = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    p0 = snapshot(p)
    p2, m2, v2 = snapshot(p), snapshot(m), snapshot(v)
    kernels.adam(p, g, m, v, group_sizes=[1] * n_groups, lr=lrs, weight_decay=wds, step=2)
    for i in range(n_groups):
        kernels.adam(p2[i], g[i], m2[i], v2[i], lr=lrs[i], weight_decay=wds[i], step=2)
    assert_all_bits_equal(p, p2, "params")
    assert_all_bits_equal(m, m2, "exp_avgs")
    assert_all_bits_equal(v, v2, "exp_avg_sqs")
    # Every group, those past the first 32 included, was updated.
    assert all(not torch.equal(a, b) for a, b in zip(p, p0))


def test_plan_reuse_equals_list_calls(device):
    sizes = [0, 7, 70001, 1]
    p = [randn(n, device=device) for n in sizes]
    m = [randn(n, device=device, scale=0.1) for n in sizes]
    v = [rand_pos(n, device=device) for n in sizes]
    vmax = snapshot(v)
    out = [torch.zeros(n, dtype=BF16, device=device) for n in sizes]
    g = [torch.zeros(n, device=device) for n in sizes]
    p2, m2, v2, vmax2, out2 = snapshot(p), snapshot(m), snapshot(v), snapshot(vmax), snapshot(out)
    plan = kernels.AdamPlan(p, g, m, v, max_exp_avg_sqs=vmax, params_out=out)
    assert plan.num_tensors == len(sizes) and plan.table.total_numel == sum(sizes)
    for step in range(1, STEPS + 1):
        new_grads = [randn(n, device=device) for n in sizes]
        for dst, src in zip(g, new_grads):
            dst.copy_(src)  # the plan holds the grads' addresses
        lr = 1e-3 / step
        kernels.adam(plan, lr=lr, step=step, weight_decay=0.01)
        kernels.adam(p2, new_grads, m2, v2, max_exp_avg_sqs=vmax2, params_out=out2, lr=lr, step=step,
                     weight_decay=0.01)
    for name, a, b in (("params", p, p2), ("exp_avgs", m, m2), ("exp_avg_sqs", v, v2),
                       ("max_exp_avg_sqs", vmax, vmax2), ("params_out", out, out2)):
        assert_all_bits_equal(a, b, name)


def test_channels_last_matches_contiguous(device):
    shape = (3, 16, 9, 11)
    p = randn(shape, device=device)
    g = [randn(shape, device=device) for _ in range(3)]
    m = randn(shape, device=device, scale=0.1)
    v = rand_pos(shape, device=device)
    cl = [t.clone().to(memory_format=torch.channels_last) for t in (p, m, v)]
    assert not cl[0].is_contiguous() and cl[0].is_contiguous(memory_format=torch.channels_last)
    contig = snapshot([p, m, v])
    for step, gs in enumerate(g, 1):
        kernels.adam(cl[0], gs.to(memory_format=torch.channels_last), cl[1], cl[2], lr=1e-3, step=step,
                     weight_decay=0.01)
        kernels.adam(contig[0], gs, contig[1], contig[2], lr=1e-3, step=step, weight_decay=0.01)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), cl, contig):
        assert a.is_contiguous(memory_format=torch.channels_last)
        assert_bits_equal(a.contiguous(), b, name)
    assert not torch.equal(contig[0], p)
