"""FusedAdam as a torch.optim.Optimizer: parity with torch.optim.Adam/AdamW on a
small real model, param groups, special parameters, bad input, repr.

Every comparison feeds both optimizers the same gradient values (computed once
per step from the FusedAdam model), so only the optimizers differ.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from conftest import assert_bits_equal, randn, saved_steps
from reference import AdamHyper
from shardadam import FusedAdam
from test_fused_adam_helpers import (RefParam, assert_opt_unchanged, assert_params_match, assert_states_match,
                                     backward, batches, clone_model, close, copy_grads, fp32_copies, make_model,
                                     snapshot_opt, true_state)

STEPS = 12
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
# With L2 decay, g + weight_decay * p can cancel to ~1e-7 where the first
# update lr * g' / (|g'| + eps) is ill-conditioned: fp32 roundings of g' of
# ~1e-10 (torch and the kernel round differently, both differ from float64)
# move the param by up to lr * 1e-10 / eps. eps = 1e-4 bounds that below the
# parity tolerance for every element.
L2_EPS = 1e-4

# name: (torch class, FusedAdam options beyond HYPER)
TORCH_CASES = {
    "adamw": (torch.optim.AdamW, {}),
    "adam-l2": (torch.optim.Adam, dict(adam_w_mode=False)),
    "adamw-amsgrad": (torch.optim.AdamW, dict(amsgrad=True)),
    "adam-l2-amsgrad": (torch.optim.Adam, dict(adam_w_mode=False, amsgrad=True)),
    "adamw-maximize": (torch.optim.AdamW, dict(maximize=True)),
    "adam-l2-maximize": (torch.optim.Adam, dict(adam_w_mode=False, maximize=True)),
}


def _torch_kwargs(opts: dict) -> dict:
    return {k: v for k, v in opts.items() if k != "adam_w_mode"}


def _moved(params, initial, what="params"):
    """The run moved the params far beyond the comparison tolerance (the test can fail)."""
    for p, p0 in zip(params, initial):
        if p.numel():
            assert (p.detach() - p0).abs().max().item() > 1e-4, f"{what} barely moved: the case tests nothing"


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_on_a_model(device, case):
    torch_cls, opts = TORCH_CASES[case]
    amsgrad = opts.get("amsgrad", False)
    model = make_model(device)
    ref = clone_model(model)
    initial = [p.detach().clone() for p in model.parameters()]
    hyper = dict(HYPER)
    if amsgrad:
        # beta2 0.99 and shrinking losses make exp_avg_sq fall well below its
        # maximum, so that the maximum changes the updates.
        hyper["betas"] = (0.9, 0.99)
    if opts.get("adam_w_mode") is False:
        hyper["eps"] = L2_EPS
    opt = FusedAdam(model.parameters(), **hyper, **opts)
    topt = torch_cls(ref.parameters(), foreach=False, **hyper, **_torch_kwargs(opts))
    for s, (x, y) in enumerate(batches(STEPS, device), 1):
        opt.zero_grad()
        backward(model, x, y, loss_scale=0.5 ** s if amsgrad else 1.0)
        copy_grads(model.parameters(), ref.parameters())
        opt.step()
        topt.step()
        assert opt.param_groups[0]["step"] == s
    params, ref_params = list(model.parameters()), list(ref.parameters())
    assert_params_match(params, ref_params)
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
    assert_states_match(opt, params, topt, ref_params, keys)
    _moved(params, initial)
    if amsgrad:
        above = sum(int((opt.state[p]["max_exp_avg_sq"] > 1.01 * opt.state[p]["exp_avg_sq"]).sum()) for p in params)
        assert above > 0.1 * sum(p.numel() for p in params), \
            "AMSGrad's maximum hardly exceeded exp_avg_sq: the case tests nothing"


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_no_bias_correction_matches_float64_reference(device, adam_w_mode):
    h = AdamHyper(lr=5e-4, beta1=0.9, beta2=0.99, eps=1e-8 if adam_w_mode else L2_EPS, weight_decay=0.05,
                  adam_w_mode=adam_w_mode, bias_correction=False)
    model = make_model(device)
    params = list(model.parameters())
    refs = [RefParam(p) for p in params]
    refs_bc = [RefParam(p) for p in params]
    h_bc = dataclasses.replace(h, bias_correction=True)
    opt = FusedAdam(params, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                    adam_w_mode=adam_w_mode, bias_correction=False)
    for s, (x, y) in enumerate(batches(STEPS, device), 1):
        opt.zero_grad()
        backward(model, x, y)
        for p, r, rb in zip(params, refs, refs_bc):
            r.step(p.grad, s, h)
            rb.step(p.grad, s, h_bc)
        opt.step()
    for i, (p, r) in enumerate(zip(params, refs)):
        close(p.detach().double().cpu().reshape(-1), r.p, f"param[{i}]")
        close(opt.state[p]["exp_avg"].double().cpu().reshape(-1), r.m, f"exp_avg[{i}]", atol_rel=1e-6)
        close(opt.state[p]["exp_avg_sq"].double().cpu().reshape(-1), r.v, f"exp_avg_sq[{i}]", atol_rel=1e-6)
    # The option mattered: the same run with bias correction ends far away.
    far = max((p.detach().double().cpu().reshape(-1) - r.p).abs().max().item() for p, r in zip(params, refs_bc))
    assert far > 1e-4, "bias_correction=False made no difference: the case tests nothing"


# ---------------------------------------------------------------- param groups

def test_param_groups_match_torch_and_reference(device):
    """Groups with their own lr/betas/eps/weight_decay/maximize match torch.optim.AdamW
    with the same groups; a bias_correction=False group matches the float64
    reference; an empty group's step advances with the others."""
    model = make_model(device)
    ref = clone_model(model)
    conv, lin1, lin2 = model[0], model[3], model[5]
    rconv, rlin1 = ref[0], ref[3]
    g0 = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    g1 = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, maximize=True)
    g3 = dict(lr=2e-3, betas=(0.85, 0.95), eps=1e-7, weight_decay=0.02, bias_correction=False)
    opt = FusedAdam([dict(params=list(conv.parameters()), **g0), dict(params=list(lin1.parameters()), **g1),
                     dict(params=[], lr=5e-3), dict(params=list(lin2.parameters()), **g3)], lr=7e-4)
    topt = torch.optim.AdamW([dict(params=list(rconv.parameters()), **g0),
                              dict(params=list(rlin1.parameters()), **g1)], foreach=False)
    h3 = AdamHyper(lr=2e-3, beta1=0.85, beta2=0.95, eps=1e-7, weight_decay=0.02, bias_correction=False)
    refs = [RefParam(p) for p in lin2.parameters()]
    assert opt.param_groups[2]["lr"] == 5e-3 and opt.param_groups[2]["params"] == []
    for s, (x, y) in enumerate(batches(STEPS, device), 1):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(model.parameters(), ref.parameters())
        for p, r in zip(lin2.parameters(), refs):
            r.step(p.grad, s, h3)
        opt.step()
        topt.step()
        assert [g["step"] for g in opt.param_groups] == [s] * 4, "every group, the empty one too, counts the step"
        sd = opt.state_dict()
        assert saved_steps(sd) == [s, s, None, s]  # torch's schema: no step for a group without state
        assert sd["param_groups"][2]["params"] == [] and sd["param_groups"][2]["lr"] == 5e-3
    mine = list(conv.parameters()) + list(lin1.parameters())
    theirs = list(rconv.parameters()) + list(rlin1.parameters())
    assert_params_match(mine, theirs)
    assert_states_match(opt, mine, topt, theirs)
    for i, (p, r) in enumerate(zip(lin2.parameters(), refs)):
        close(p.detach().double().cpu().reshape(-1), r.p, f"no-bias-correction group param[{i}]")
    # The groups' hyperparameters mattered: lin1 (maximize) went another way than plain AdamW would.
    assert opt.param_groups[1]["maximize"] is True and opt.param_groups[3]["bias_correction"] is False


def test_add_param_group_after_steps_matches_torch(device):
    model = make_model(device)
    ref = clone_model(model)
    conv, rconv = model[0], ref[0]
    late = list(model[3].parameters()) + list(model[5].parameters())
    rlate = list(ref[3].parameters()) + list(ref[5].parameters())
    late0 = [p.detach().clone() for p in late]
    opt = FusedAdam(conv.parameters(), lr=2e-3, weight_decay=0.01)
    topt = torch.optim.AdamW(rconv.parameters(), lr=2e-3, weight_decay=0.01, foreach=False)
    data = batches(8, device)
    for x, y in data[:3]:
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(model.parameters(), ref.parameters())
        opt.step()
        topt.step()
    for p, p0 in zip(late, late0):  # not in the optimizer yet: untouched
        assert_bits_equal(p, p0, "param outside the optimizer")
    conv_state = {k: v.clone() for k, v in opt.state[conv.weight].items()}
    new_group = dict(lr=4e-3, betas=(0.8, 0.99), weight_decay=0.1)
    opt.add_param_group(dict(params=late, **new_group))
    topt.add_param_group(dict(params=rlate, **new_group))
    # Earlier state is kept when the layout changes.
    for k, v in conv_state.items():
        assert_bits_equal(opt.state[conv.weight][k], v, f"conv state '{k}' after add_param_group")
    for x, y in data[3:]:
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(model.parameters(), ref.parameters())
        opt.step()
        topt.step()
    assert [g["step"] for g in opt.param_groups] == [8, 5]
    assert_params_match(model.parameters(), ref.parameters())
    assert_states_match(opt, list(model.parameters()), topt, list(ref.parameters()))


# ---------------------------------------------------------------- special parameters

def test_zero_size_parameters(device):
    model = make_model(device)
    params = list(model.parameters())
    empties = [nn.Parameter(torch.empty(0, 5, device=device)), nn.Parameter(torch.empty(3, 0, device=device))]
    mine = params[:1] + [empties[0]] + params[1:4] + [empties[1]] + params[4:]
    theirs = fp32_copies(mine)
    opt = FusedAdam(mine, **HYPER)
    topt = torch.optim.AdamW(theirs, foreach=False, **HYPER)
    for x, y in batches(5, device):
        opt.zero_grad()
        backward(model, x, y)
        for e in empties:
            e.grad = torch.zeros_like(e)
        copy_grads(mine, theirs)
        opt.step()
        topt.step()
    assert_params_match(mine, theirs)
    assert_states_match(opt, mine, topt, theirs)
    for e in empties:
        assert opt.state[e]["exp_avg"].shape == e.shape and opt.state[e]["exp_avg_sq"].shape == e.shape
    sd = opt.state_dict()
    assert sd["state"][1]["exp_avg"].shape == (0, 5) and sd["state"][5]["exp_avg_sq"].shape == (3, 0)


def test_channels_last_model_matches_torch(device):
    model = make_model(device).to(memory_format=torch.channels_last)
    w = model[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    ref = clone_model(model)
    opt = FusedAdam(model.parameters(), **HYPER)
    topt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    for x, y in batches(STEPS, device, channels_last=True):
        opt.zero_grad()
        backward(model, x, y)
        assert w.grad.stride() == w.stride()
        copy_grads(model.parameters(), ref.parameters())
        opt.step()
        topt.step()
    assert w.is_contiguous(memory_format=torch.channels_last)
    for k in ("exp_avg", "exp_avg_sq"):
        assert opt.state[w][k].stride() == w.stride(), f"state '{k}' does not follow the param's memory format"
    assert_params_match(model.parameters(), ref.parameters())
    assert_states_match(opt, list(model.parameters()), topt, list(ref.parameters()))


def test_params_without_grad_are_skipped_like_torch(device):
    """A param whose grad is None in a step keeps its value and state bit for
    bit that step (like torch.optim); the others step normally, groups intact.
    FusedAdam counts steps per group (documented), so after a skip the skipped
    param follows the float64 reference with the group's step numbers."""
    model = make_model(device)
    ref = clone_model(model)
    params, rparams = list(model.parameters()), list(ref.parameters())
    g0 = dict(lr=1e-3, weight_decay=0.01)
    g1 = dict(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99))
    opt = FusedAdam([dict(params=params[:4], **g0), dict(params=params[4:], **g1)])
    topt = torch.optim.AdamW([dict(params=rparams[:4], **g0), dict(params=rparams[4:], **g1)], foreach=False)
    hyper = [AdamHyper(lr=1e-3, weight_decay=0.01), AdamHyper(lr=3e-3, beta1=0.8, beta2=0.99, weight_decay=0.1)]
    group_of = [0] * 4 + [1] * 2
    refs = [RefParam(p) for p in params]
    drops = {3: [5], 4: [5, 0], 6: [2]}  # step -> indexes of params without grad that step
    dropped_ever = {i for d in drops.values() for i in d}
    for s, (x, y) in enumerate(batches(8, device), 1):
        opt.zero_grad()
        backward(model, x, y)
        for i in drops.get(s, []):
            params[i].grad = None
        copy_grads(params, rparams)
        for i, (p, r) in enumerate(zip(params, refs)):
            if p.grad is not None:
                r.step(p.grad, s, hyper[group_of[i]])
        skipped = [params[i] for i in drops.get(s, [])]
        before = snapshot_opt(opt, skipped)
        others_before = [p.detach().clone() for p in params]
        opt.step()
        topt.step()
        assert [g["step"] for g in opt.param_groups] == [s, s]
        before["steps"] = [s, s]
        assert_opt_unchanged(opt, skipped, before, f"step {s}, params without grad")
        for i, p in enumerate(params):
            if p.grad is not None:
                assert not torch.equal(p.detach(), others_before[i]), f"step {s}: param[{i}] with grad did not move"
    never = [i for i in range(len(params)) if i not in dropped_ever]
    assert_params_match([params[i] for i in never], [rparams[i] for i in never])
    assert_states_match(opt, [params[i] for i in never], topt, [rparams[i] for i in never])
    for i, (p, r) in enumerate(zip(params, refs)):
        close(p.detach().double().cpu().reshape(-1), r.p, f"param[{i}] vs float64 reference")
        close(opt.state[p]["exp_avg"].double().cpu().reshape(-1), r.m, f"exp_avg[{i}] vs reference", atol_rel=1e-6)


@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_params_without_grad_with_low_precision_states(device, state_dtype):
    """The partial step (some params without grad) with fp16 (scaled) or bf16
    states: skipped params keep states and scales bit for bit, and the run
    tracks the same run with fp32 states within the states' rounding."""
    model = make_model(device)
    ref = clone_model(model)
    params, rparams = list(model.parameters()), list(ref.parameters())
    initial = [p.detach().clone() for p in params]

    def groups(ps):
        return [dict(params=ps[:4], lr=1e-3), dict(params=ps[4:], lr=3e-3, betas=(0.8, 0.99))]

    opt = FusedAdam(groups(params), weight_decay=0.01, exp_avg_dtype=state_dtype, exp_avg_sq_dtype=state_dtype)
    ropt = FusedAdam(groups(rparams), weight_decay=0.01)
    drops = {2: [5, 1], 3: [0], 5: [2, 3, 4]}
    for s, (x, y) in enumerate(batches(7, device), 1):
        opt.zero_grad()
        backward(model, x, y)
        for i in drops.get(s, []):
            params[i].grad = None
        copy_grads(params, rparams)
        skipped = [params[i] for i in drops.get(s, [])]
        before = snapshot_opt(opt, skipped)
        opt.step()
        ropt.step()
        before["steps"] = [s, s]
        assert_opt_unchanged(opt, skipped, before, f"step {s}, params without grad")
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[state_dtype]
    for i, (p, r) in enumerate(zip(params, rparams)):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][k].dtype == state_dtype
            if state_dtype == torch.float16:
                scale = opt.state[p][k + "_scale"].item()
                assert scale > 1.0 and scale == 2.0 ** round(math.log2(scale)), f"{k}_scale[{i}] = {scale}"
            close(true_state(opt, p, k), ropt.state[r][k], f"{k}[{i}]", rtol=2 * ulp, atol_rel=2 * ulp)
        moved = r.detach() - initial[i]
        close(p.detach() - initial[i], moved, f"param[{i}] update", rtol=0, atol_rel=2 * ulp)


def test_step_without_any_grad_changes_nothing_but_the_counter(device):
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam(params, **HYPER)
    for x, y in batches(2, device):
        opt.zero_grad()
        backward(model, x, y)
        opt.step()
    opt.zero_grad()  # set_to_none: no grad at all
    before = snapshot_opt(opt, params)
    opt.step()
    assert opt.param_groups[0]["step"] == 3
    before["steps"] = [3]
    assert_opt_unchanged(opt, params, before, "step without grads")


def test_frozen_params_untouched(device):
    model = make_model(device)
    frozen = [model[0].weight, model[0].bias, model[3].bias]
    for p in frozen:
        p.requires_grad_(False)
    ref = clone_model(model)
    frozen0 = [p.detach().clone() for p in frozen]
    opt = FusedAdam(model.parameters(), **HYPER)
    topt = torch.optim.AdamW(ref.parameters(), foreach=False, **HYPER)
    for x, y in batches(6, device):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(model.parameters(), ref.parameters())
        opt.step()
        topt.step()
    for i, (p, p0) in enumerate(zip(frozen, frozen0)):
        assert_bits_equal(p, p0, f"frozen param[{i}]")
        assert len(opt.state.get(p, {})) == 0, "a frozen param got optimizer state"
    assert sorted(opt.state_dict()["state"]) == sorted(topt.state_dict()["state"]) == [2, 4, 5]
    assert_params_match(model.parameters(), ref.parameters())


def test_unfrozen_param_is_trained(device):
    """A param frozen when training started and unfrozen later (progressive
    unfreezing) is updated once it has gradients, like torch.optim does."""
    model = make_model(device)
    w = model[3].weight
    w.requires_grad_(False)
    opt = FusedAdam(model.parameters(), **HYPER)
    h = AdamHyper(lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=HYPER["weight_decay"])
    data = batches(6, device)
    for x, y in data[:3]:
        opt.zero_grad()
        backward(model, x, y)
        opt.step()
    w.requires_grad_(True)
    w0 = w.detach().clone()
    r = RefParam(w)
    for s, (x, y) in enumerate(data[3:], 4):
        opt.zero_grad()
        backward(model, x, y)
        assert w.grad is not None
        r.step(w.grad, s, h)  # FusedAdam counts steps per group
        opt.step()
    assert not torch.equal(w.detach(), w0), "the unfrozen param was never updated although it had gradients"
    close(w.detach().double().cpu().reshape(-1), r.p, "unfrozen param vs float64 reference")


def test_thousands_of_small_params_match_torch(device):
    n = 3000
    shapes = []
    for i in range(n):
        ndim = int(torch.randint(1, 4, ()))
        shapes.append(tuple(int(d) for d in torch.randint(1, 7, (ndim,))))
        if i % 500 == 7:
            shapes[-1] = (0,) + shapes[-1][1:]
    plist = nn.ParameterList([nn.Parameter(randn(s, device=device)) for s in shapes])
    mine = list(plist)
    theirs = fp32_copies(mine)
    initial = [p.detach().clone() for p in mine]
    groups = lambda ps: [dict(params=ps[:1700]), dict(params=ps[1700:], lr=3e-3, weight_decay=0.1)]  # noqa: E731
    opt = FusedAdam(groups(mine), lr=1e-3, weight_decay=0.01)
    topt = torch.optim.AdamW(groups(theirs), lr=1e-3, weight_decay=0.01, foreach=False)
    for _ in range(3):
        for p in mine:
            p.grad = randn(p.shape, device=device)
        copy_grads(mine, theirs)
        opt.step()
        topt.step()
    assert_params_match(mine, theirs, initial=initial)
    assert_states_match(opt, mine, topt, theirs, list_magnitude=True)


# ---------------------------------------------------------------- bad input

def test_sparse_gradients_rejected(device):
    emb = nn.Embedding(10, 4, sparse=True).to(device)
    opt = FusedAdam(emb.parameters())
    emb(torch.tensor([1, 2, 2], device=device)).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_gradient_laid_out_unlike_its_parameter_is_refused_with_the_fix(device):
    """A transposed gradient would pair each element with another parameter
    element: refused, naming the parameter and how to lay the gradient out,
    before anything changes."""
    lin = nn.Linear(5, 3).to(device)
    opt = FusedAdam(lin.parameters())
    for p in lin.parameters():
        p.grad = randn(p.shape, device=device)
    opt.step()
    lin.weight.grad = randn((5, 3), device=device).t()
    assert lin.weight.grad.shape == lin.weight.shape and not lin.weight.grad.is_contiguous()
    before = snapshot_opt(opt, list(lin.parameters()))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] has strides \(1, 3\) but the "
                                         r"parameter \(5, 1\).*torch.empty_like\(p\).copy_\(g\)"):
        opt.step()
    assert_opt_unchanged(opt, list(lin.parameters()), before, "after the refused step")
    lin.weight.grad = torch.empty_like(lin.weight).copy_(lin.weight.grad)
    opt.step()


def test_failed_step_changes_nothing(device):
    """A step that raises (sparse gradient) leaves params, state and the step counter as they were."""
    emb = nn.Embedding(10, 4, sparse=True).to(device)
    lin = nn.Linear(4, 3).to(device)
    params = list(emb.parameters()) + list(lin.parameters())
    opt = FusedAdam(params)
    for p in params:  # one good step first, with dense grads
        p.grad = randn(p.shape, device=device)
    opt.step()
    opt.zero_grad()
    lin(emb(torch.tensor([1, 2, 2], device=device))).sum().backward()
    before = snapshot_opt(opt, params)
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert_opt_unchanged(opt, params, before, "after a failed step")


@pytest.mark.cuda
def test_mixed_devices_in_one_group_rejected():
    a, b = nn.Parameter(randn(4)), nn.Parameter(randn(4, device="cuda"))
    with pytest.raises(ValueError, match="several devices"):
        FusedAdam([a, b])
    # One group per device is fine, and both groups train.
    opt = FusedAdam([dict(params=[a]), dict(params=[b])], lr=1e-2)
    a0, b0 = a.detach().clone(), b.detach().clone()
    a.grad, b.grad = randn(4), randn(4, device="cuda")
    opt.step()
    assert not torch.equal(a.detach(), a0) and not torch.equal(b.detach(), b0)


def test_same_param_twice_in_one_group_rejected():
    a = nn.Parameter(randn(4))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="appears twice"):
        FusedAdam([a, a])


def test_same_param_in_two_groups_rejected():
    a, b = nn.Parameter(randn(4)), nn.Parameter(randn(3))
    with pytest.raises(ValueError, match="group"):
        FusedAdam([dict(params=[a, b]), dict(params=[b])])
    opt = FusedAdam([a])
    with pytest.raises(ValueError, match="group"):
        opt.add_param_group(dict(params=[a]))


def test_float64_param_rejected():
    with pytest.raises(ValueError, match="float64"):
        FusedAdam([nn.Parameter(randn(4)), nn.Parameter(randn(4, torch.float64))])


def test_capturable_with_cpu_params_rejected():
    with pytest.raises(ValueError, match="capturable"):
        FusedAdam([nn.Parameter(randn(4))], capturable=True)


BAD_HYPER = {
    "negative-lr": (dict(lr=-1e-3), "lr"),
    "nan-lr": (dict(lr=float("nan")), "lr"),
    "beta1-one": (dict(betas=(1.0, 0.999)), "betas"),
    "beta2-negative": (dict(betas=(0.9, -0.1)), "betas"),
    "beta2-above-one": (dict(betas=(0.9, 1.5)), "betas"),
    "one-beta": (dict(betas=(0.9,)), "betas"),
    "negative-eps": (dict(eps=-1e-8), "eps"),
    "negative-weight-decay": (dict(weight_decay=-0.1), "weight_decay"),
}


@pytest.mark.parametrize("case", list(BAD_HYPER))
def test_bad_hyperparameters_rejected(case):
    kw, word = BAD_HYPER[case]
    with pytest.raises(ValueError, match=word):
        FusedAdam([nn.Parameter(randn(4))], **kw)
    # The same values in a group dict are checked too.
    with pytest.raises(ValueError, match=word):
        FusedAdam([dict(params=[nn.Parameter(randn(4))], **kw)])


BAD_DTYPES = {
    "exp_avg-float64": (dict(exp_avg_dtype=torch.float64), "exp_avg_dtype"),
    "exp_avg-int8": (dict(exp_avg_dtype=torch.int8), "exp_avg_dtype"),
    "exp_avg_sq-float64": (dict(exp_avg_sq_dtype=torch.float64), "exp_avg_sq_dtype"),
    "exp_avg_sq-int16": (dict(exp_avg_sq_dtype=torch.int16), "exp_avg_sq_dtype"),
    "master-bf16": (dict(master_weights=True, master_weight_dtype=torch.bfloat16), "master_weight_dtype"),
    "master-float64": (dict(master_weights=True, master_weight_dtype=torch.float64), "master_weight_dtype"),
    "remainders-fp16-master": (dict(store_param_remainders=True, master_weight_dtype=torch.float16),
                               "store_param_remainders"),
}


@pytest.mark.parametrize("case", list(BAD_DTYPES))
def test_invalid_state_dtypes_rejected(case):
    kw, word = BAD_DTYPES[case]
    with pytest.raises(ValueError, match=word):
        FusedAdam([nn.Parameter(randn(4, torch.bfloat16))], **kw)


def test_rejected_add_param_group_changes_nothing(device):
    """add_param_group that raises leaves param_groups as they were, and
    training goes on exactly like an optimizer that never saw the bad group."""
    model = make_model(device)
    ref = clone_model(model)
    opt = FusedAdam(model[0].parameters(), **HYPER)
    control = FusedAdam(ref[0].parameters(), **HYPER)
    bad_groups = [
        dict(params=list(model[3].parameters()), lr=-1.0),
        dict(params=list(model[3].parameters()), betas=(0.9, 1.0)),
        dict(params=[model[0].weight]),  # already in group 0
        dict(params=[nn.Parameter(randn(3, torch.float64, device))]),
    ]
    for s, (x, y) in enumerate(batches(4, device)):
        if s < len(bad_groups):
            with pytest.raises(ValueError):
                opt.add_param_group(bad_groups[s])
            assert len(opt.param_groups) == 1, f"a rejected group was kept: {len(opt.param_groups)} groups"
        for m, o in ((model, opt), (ref, control)):
            o.zero_grad()
            backward(m, x, y)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bits_equal(p, q, "param after rejected add_param_group")


# ---------------------------------------------------------------- repr

def test_repr_lists_groups_and_options():
    a, b, c = (nn.Parameter(randn(n, torch.bfloat16)) for n in (3, 4, 5))
    opt = FusedAdam([dict(params=[a, b]), dict(params=[c], lr=0.01, weight_decay=0.1, maximize=True)],
                    lr=1e-3, amsgrad=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16,
                    master_weights=True, bias_correction=False)
    text = repr(opt)
    lines = text.splitlines()
    assert lines[0].startswith("FusedAdam")
    g0 = next(line for line in lines if "group 0" in line)
    g1 = next(line for line in lines if "group 1" in line)
    assert "2 params" in g0 and "lr=0.001" in g0 and "weight_decay=0.0" in g0 and "step=0" in g0
    assert "bias_correction=False" in g0 and "maximize=False" in g0 and "betas=(0.9, 0.999)" in g0
    assert "1 params" in g1 and "lr=0.01" in g1 and "weight_decay=0.1" in g1 and "maximize=True" in g1
    for opt_text in ("amsgrad=True", "exp_avg_dtype=bfloat16", "exp_avg_sq_dtype=float16", "master_weights=True",
                     "adam_w_mode=True", "capturable=False", "flat_grads=False", "store_param_remainders=False"):
        assert opt_text in text, f"{opt_text!r} missing from repr:\n{text}"
    for p in (a, b, c):
        p.grad = randn(p.shape, torch.bfloat16)
    opt.step()
    assert "step=1" in next(line for line in repr(opt).splitlines() if "group 1" in line)


def test_step_with_closure_matches_torch(device):
    """step(closure) re-evaluates the loss with gradients enabled and returns it."""
    models = [nn.Linear(5, 2).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [FusedAdam(models[0].parameters(), lr=1e-2), torch.optim.AdamW(models[1].parameters(), lr=1e-2,
                                                                          weight_decay=0.0, foreach=False)]
    x = randn((4, 5), device=device)
    for _ in range(3):
        losses = []
        for m, o in zip(models, opts):
            def closure(m=m, o=o):
                o.zero_grad()
                loss = m(x).pow(2).mean()
                loss.backward()
                return loss
            with torch.no_grad():  # the closure must still get gradients
                losses.append(o.step(closure))
        torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
