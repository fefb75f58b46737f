"""FusedMuon against torch.optim.Muon (and torch.optim.AdamW for
use_muon=False groups), and its orthogonalization against float64 math.

torch.optim.Muon orthogonalizes in bf16, so whole-run comparisons use the
relative Frobenius error of each parameter's total movement over several
steps. MOVE_TOL separates agreement from a real difference: an exact fp32
Newton-Schulz lands up to about 3% from torch's bf16 one, a 10% learning-rate
error 10-11% (test_tolerance_separates_a_wrong_lr pins the latter)."""
from __future__ import annotations

import pytest
import torch

from shardadam import FusedMuon

from muon_reference import (DEFAULT_NS, gradients, newton_schulz64, polar_factor64, relative_error, run,
                            well_conditioned)

MOVE_TOL = 0.05
SHAPES = [(32, 64), (64, 32), (48, 48), (32, 64)]  # two of one shape: one batch


def _params(device, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


def _movement_errors(params, fused, reference):
    return [relative_error(f - p, r - p) for p, f, r in zip(params, fused, reference)]


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(device, adjust_lr_fn, nesterov):
    params = _params(device)
    grads = gradients(params, steps=5)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    fused = run(lambda ps: FusedMuon(ps, **kw), params, grads)
    ref = run(lambda ps: torch.optim.Muon(ps, **kw), params, grads)
    errors = _movement_errors(params, fused, ref)
    assert max(errors) < MOVE_TOL, errors


def test_tolerance_separates_a_wrong_lr(device):
    """The comparison fails for a 10% learning-rate error: MOVE_TOL has teeth."""
    params = _params(device)
    grads = gradients(params, steps=5)
    fused = run(lambda ps: FusedMuon(ps, lr=0.022), params, grads)
    ref = run(lambda ps: torch.optim.Muon(ps, lr=0.02), params, grads)
    assert min(_movement_errors(params, fused, ref)) > 1.5 * MOVE_TOL


def test_weight_decay_alone_matches_torch_exactly(device):
    """A zero gradient: the update is 0 and only the decoupled decay moves the
    parameters, p * (1 - lr * wd), rounded as torch rounds it."""
    params = _params(device)
    zeros = [[torch.zeros(p.shape) for p in params]] * 3
    fused = run(lambda ps: FusedMuon(ps, lr=0.05, weight_decay=0.3), params, zeros)
    ref = run(lambda ps: torch.optim.Muon(ps, lr=0.05, weight_decay=0.3), params, zeros)
    for f, r in zip(fused, ref):
        torch.testing.assert_close(f, r, rtol=0, atol=0)


def _one_step_update(device, shapes, **kw):
    """-(movement) / lr_ratio of one step from zero momentum, no decay, lr=1:
    the orthogonalized gradient itself."""
    grads = [well_conditioned(*s[-2:], seed=i) if len(s) == 2 else
             torch.stack([well_conditioned(*s[-2:], seed=10 * i + j) for j in range(s[0])])
             for i, s in enumerate(shapes)]
    params = [torch.zeros(s, device=device) for s in shapes]
    moved = run(lambda ps: FusedMuon(ps, lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, **kw), params,
                [grads])
    ratios = [max(1.0, s[-2] / s[-1]) ** 0.5 for s in shapes]
    return grads, [-m.cpu().double() / r for m, r in zip(moved, ratios)]


@pytest.mark.parametrize("shapes", [[(16, 40), (40, 16)], [(3, 24, 8), (2, 8, 24), (20, 20)]],
                         ids=["2d", "3d"])
def test_orthogonalized_update_is_the_polar_factor(device, shapes):
    """A converging Newton-Schulz (the cubic 1.5 X - 0.5 X X^T X, 40 steps,
    fp32) makes each matrix's update U V^T, its float64 SVD polar factor;
    3-D parameters are orthogonalized matrix by matrix."""
    grads, updates = _one_step_update(device, shapes, ns_coefficients=(1.5, -0.5, 0.0), ns_steps=40,
                                      ns_dtype=torch.float32)
    for g, u in zip(grads, updates):
        torch.testing.assert_close(u, polar_factor64(g), rtol=0, atol=2e-6)


@pytest.mark.parametrize("ns_dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 0.06)])
def test_default_iteration_matches_float64(device, ns_dtype, atol):
    """torch's quintic (which stops short of U V^T by design) in fp32 and in
    bf16, against the same iteration in float64."""
    shapes = [(24, 56), (56, 24), (2, 32, 32)]
    grads, updates = _one_step_update(device, shapes, ns_dtype=ns_dtype)
    for g, u in zip(grads, updates):
        expected = torch.stack([newton_schulz64(m, DEFAULT_NS, 5) for m in g]) if g.ndim == 3 else \
            newton_schulz64(g, DEFAULT_NS, 5)
        torch.testing.assert_close(u, expected, rtol=0, atol=atol)


def test_3d_parameter_is_a_batch_of_matrices(device):
    """A [experts, rows, cols] parameter moves as torch.optim.Muon moves each
    expert's matrix as a parameter of its own (lr adjusted by rows x cols)."""
    experts = _params(device, [(4, 48, 16)])[0]
    grads = gradients([experts], steps=4)
    kw = dict(lr=0.02, adjust_lr_fn="original")
    fused = run(lambda ps: FusedMuon(ps, **kw), [experts], grads)[0]
    ref = run(lambda ps: torch.optim.Muon(ps, **kw), list(experts.unbind(0)),
              [list(g[0].unbind(0)) for g in grads])
    errors = [relative_error(f - p, r - p) for p, f, r in zip(experts.unbind(0), fused.unbind(0), ref)]
    assert max(errors) < MOVE_TOL, errors


def test_changing_gradient_sets_and_moved_parameters_follow_torch(device):
    """The step's plans are reused while nothing changes and rebuilt when a
    parameter has no gradient (it is left alone, as torch leaves it) or was
    moved to new memory (p.data = ...)."""
    params = _params(device)
    grads = gradients(params, steps=5)
    grads[1][0] = grads[2][3] = None
    kw = dict(lr=0.02)
    ps = [p.clone().requires_grad_(True) for p in params]
    opt = FusedMuon(ps, **kw)
    for i, step_grads in enumerate(grads):
        if i == 3:
            ps[2].data = ps[2].data.clone()
        for p, g in zip(ps, step_grads):
            p.grad = None if g is None else g.to(device)
        opt.step()
    ref = run(lambda qs: torch.optim.Muon(qs, **kw), params, grads)
    assert max(_movement_errors(params, ps, ref)) < MOVE_TOL


def _mixed_params(device):
    return _params(device, [(32, 64), (64, 16), (64,), (16, 8, 8)]) + [torch.randn(10, 4).to(device)]


def test_mixed_groups_match_torch_muon_and_adamw(device):
    """Matrices by Muon, the rest by AdamW (lr, betas, eps, weight_decay of
    their group), as torch.optim.Muon + torch.optim.AdamW; a parameter
    without a gradient in a step is left alone by both."""
    params = _mixed_params(device)
    grads = gradients(params, steps=4)
    grads[1][2] = None  # the 1-D parameter skips step 2: its AdamW step counter falls behind
    adamw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)

    def fused_opt(ps):
        return FusedMuon([dict(params=ps[:2]), dict(params=ps[2:], use_muon=False, **adamw)], lr=0.02)

    def torch_opts(ps):
        return [torch.optim.Muon(ps[:2], lr=0.02), torch.optim.AdamW(ps[2:], **adamw)]

    fused = run(fused_opt, params, grads)
    ref = run(torch_opts, params, grads)
    assert max(_movement_errors(params[:2], fused[:2], ref[:2])) < MOVE_TOL
    for f, r in zip(fused[2:], ref[2:]):
        torch.testing.assert_close(f, r, rtol=1e-6, atol=1e-7)


def test_adamw_group_defaults_are_torch_adamw():
    opt = FusedMuon([dict(params=[torch.zeros(4, 4)]), dict(params=[torch.zeros(4)], use_muon=False)], lr=0.02)
    muon, adamw = opt.param_groups
    assert {k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay")} == dict(
        lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    assert "momentum" not in adamw and "ns_steps" not in adamw
    assert muon["lr"] == 0.02 and "use_muon" not in muon


# ---------------------------------------------------------------- state dicts


def _steps(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.device, p.dtype)
        opt.step()


@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_state_dict_round_trip_with_torch(device, direction):
    """Three steps with one, a state dict into the other, two more steps:
    the same as five steps of torch.optim.Muon."""
    params = _params(device)
    grads = gradients(params, steps=5)
    kinds = dict(torch_to_fused=(torch.optim.Muon, FusedMuon), fused_to_torch=(FusedMuon, torch.optim.Muon))
    first_cls, second_cls = kinds[direction]
    ps = [p.clone() for p in params]
    first = first_cls(ps, lr=0.02)
    _steps(first, ps, grads[:3])
    sd = first.state_dict()
    assert {k for s in sd["state"].values() for k in s} == {"momentum_buffer"}
    second = second_cls(ps, lr=0.5)  # the loaded groups replace its hyperparameters
    second.load_state_dict(sd)
    assert second.param_groups[0]["lr"] == 0.02
    for p in ps:
        torch.testing.assert_close(second.state[p]["momentum_buffer"], first.state[p]["momentum_buffer"],
                                   rtol=0, atol=0)
    _steps(second, ps, grads[3:])
    ref = run(lambda qs: torch.optim.Muon(qs, lr=0.02), params, grads)
    assert max(_movement_errors(params, ps, ref)) < MOVE_TOL


def test_state_dict_keys_are_torch_muons():
    p = torch.randn(8, 4, requires_grad=True)
    fused, ref = FusedMuon([p]), torch.optim.Muon([p])
    assert fused.state_dict()["param_groups"] == ref.state_dict()["param_groups"]


def test_mixed_state_dict_resumes_exactly(device):
    """A FusedMuon checkpoint of Muon and AdamW groups (torch's keys: the
    AdamW ones with exp_avg, exp_avg_sq and a step per parameter) resumes
    bit for bit."""
    params = _mixed_params(device)
    grads = gradients(params, steps=5)
    grads[0][3] = None

    def make(ps):
        return FusedMuon([dict(params=ps[:2]), dict(params=ps[2:], use_muon=False, lr=1e-2)], lr=0.02)

    straight = run(make, params, grads)
    ps = [p.clone() for p in params]
    first = make(ps)
    for step_grads in grads[:3]:
        for p, g in zip(ps, step_grads):
            p.grad = None if g is None else g.to(p.device)
        first.step()
    sd = first.state_dict()
    assert set(sd["state"][2]) == {"exp_avg", "exp_avg_sq", "step"}
    assert sd["state"][2]["step"].device.type == "cpu" and float(sd["state"][2]["step"]) == 3
    assert float(sd["state"][3]["step"]) == 2
    second = make(ps)
    second.load_state_dict(sd)
    for step_grads in grads[3:]:
        for p, g in zip(ps, step_grads):
            p.grad = None if g is None else g.to(p.device)
        second.step()
    for p, s in zip(ps, straight):
        torch.testing.assert_close(p, s, rtol=0, atol=0)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad, match", [
    (dict(shape=(8,)), "orthogonalizes matrices"),
    (dict(shape=(2, 2, 2, 2)), "orthogonalizes matrices"),
    (dict(dtype=torch.int32), "dtype torch.int32"),
    (dict(ns_steps=100), "ns_steps"),
    (dict(ns_steps=-1), "ns_steps"),
    (dict(ns_steps=2.0), "ns_steps"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (dict(ns_coefficients=(1.0, float("nan"), 2.0)), r"ns_coefficients\[1\]"),
    (dict(ns_coefficients=(1.0, "b", 2.0)), r"ns_coefficients\[1\]"),
    (dict(momentum=1.5), "momentum"),
    (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
    (dict(eps=0.0), "eps"),
    (dict(lr=-1.0), "lr"),
])
def test_bad_construction_raises_value_error(bad, match):
    bad = dict(bad)
    p = torch.zeros(bad.pop("shape", (4, 4)), dtype=bad.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        FusedMuon([p], **bad)


def test_rejected_group_leaves_the_optimizer_as_it_was():
    opt = FusedMuon([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match="use_muon=False"):
        opt.add_param_group(dict(params=[torch.zeros(3)]))
    with pytest.raises(ValueError, match="only Muon groups take"):
        opt.add_param_group(dict(params=[torch.zeros(3)], use_muon=False, momentum=0.9))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("spoil, match", [
    (lambda opt, ps: opt.param_groups[0].update(ns_steps=100), "ns_steps"),
    (lambda opt, ps: opt.param_groups[0].update(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (lambda opt, ps: setattr(ps[1].grad, "data", torch.zeros(3, 5)), "shape"),
    (lambda opt, ps: setattr(ps[1], "grad", torch.zeros(4, 4).t()), "non-contiguous"),
])
def test_bad_step_raises_before_anything_is_written(spoil, match):
    ps = [torch.randn(4, 4, requires_grad=True) for _ in range(2)] + [torch.randn(3, requires_grad=True)]
    opt = FusedMuon([dict(params=ps[:2]), dict(params=ps[2:], use_muon=False)])
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in ps] + [v.clone() for p in ps for v in opt.state[p].values()]
    spoil(opt, ps)
    with pytest.raises(ValueError, match=match):
        opt.step()
    after = [p.detach() for p in ps] + [v for p in ps for v in opt.state[p].values()]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_capturable_needs_cuda_parameters():
    with pytest.raises(ValueError, match="capturable=True needs CUDA"):
        FusedMuon([torch.zeros(4, 4)], capturable=True)
