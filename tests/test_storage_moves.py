"""FusedAdam when storage moves under it (README "Guarantees").

Each case is an ordinary action after the optimizer has taken a step and
cached addresses: the optimizer must follow the new memory (as torch.optim,
which caches nothing) or refuse before anything changes, and must never write
the memory a parameter or gradient used to have. Old storage is kept alive by
the test, so a write into it is seen instead of corrupting the heap.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_bits_equal, randn
from shardadam import FusedAdam
from test_fused_adam_helpers import (BF16, F32, assert_opt_unchanged, assert_params_match, backward, batches,
                                     clone_model, copy_grads, make_model, snapshot_opt)

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def _trained(device, steps=2, **kw):
    """A model and a FusedAdam that has taken `steps` steps."""
    model = make_model(device)
    opt = FusedAdam(model.parameters(), **HYPER, **kw)
    for x, y in batches(steps, device):
        opt.zero_grad()
        backward(model, x, y)
        opt.step()
    return model, opt


def _step(model, opt, x, y):
    opt.zero_grad()
    backward(model, x, y)
    opt.step()


def _old_storages(model):
    """The current tensors, kept alive (and their bits copied) to show that a later step leaves them alone."""
    held = [p.data for p in model.parameters()]
    return held, [t.clone() for t in held]


def _assert_untouched(held, copies, model):
    """Storage a parameter left (a conversion that changes nothing keeps it) was not written."""
    moved = 0
    for i, (t, c, p) in enumerate(zip(held, copies, model.parameters())):
        if t.data_ptr() != p.data_ptr():
            moved += 1
            assert_bits_equal(t, c, f"old storage of param[{i}] was written after the parameter moved")
    assert moved, "the conversion moved no parameter: the test tests nothing"


def _reference_after(model, opt, convert, **kw):
    """An optimizer built fresh on a converted copy of the model, with the
    first optimizer's state loaded: what 'following the new storage' means."""
    ref_model = clone_model(model)
    convert(ref_model)
    ref = FusedAdam(ref_model.parameters(), **HYPER, **kw)
    ref.load_state_dict(opt.state_dict())
    return ref_model, ref


@pytest.mark.parametrize("convert", [
    pytest.param(lambda m: m.to(BF16), id="to-bf16"),
    pytest.param(lambda m: m.half().float(), id="half-float"),
    pytest.param(lambda m: m.to(memory_format=torch.channels_last), id="channels-last"),
])
def test_model_conversion_after_a_step_is_followed(device, convert):
    model, opt = _trained(device)
    ref_model, ref = _reference_after(model, opt, convert)
    held, copies = _old_storages(model)
    convert(model)
    dtype = next(model.parameters()).dtype
    for x, y in batches(3, device, dtype):
        _step(model, opt, x, y)
        copy_grads(model.parameters(), ref_model.parameters())
        ref.step()
    _assert_untouched(held, copies, model)
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_bits_equal(p, q, f"param[{i}]")
        for k in ("exp_avg", "exp_avg_sq"):
            assert_bits_equal(opt.state[p][k], ref.state[q][k], f"state[{i}]['{k}']")


def test_swap_tensors_conversion_is_followed(device):
    model, opt = _trained(device)
    ids = [id(p) for p in model.parameters()]
    held, copies = _old_storages(model)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(BF16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert [id(p) for p in model.parameters()] == ids, "swap keeps the parameter objects"
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in batches(2, device, BF16):
        _step(model, opt, x, y)
    _assert_untouched(held, copies, model)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before)), "the new storage did not train"


def test_param_data_replaced_with_same_shape_is_followed(device):
    model, opt = _trained(device)
    p = model[0].weight
    old, old_copy = p.data, p.data.clone()
    p.data = randn(p.shape, device=device)
    new_value = p.detach().clone()
    x, y = batches(1, device)[0]
    _step(model, opt, x, y)
    assert_bits_equal(old, old_copy, "the replaced storage was written")
    assert not torch.equal(p.detach(), new_value), "the new storage did not train"


def test_param_data_with_another_shape_is_refused_before_anything_changes(device):
    model, opt = _trained(device)
    x, y = batches(1, device)[0]
    opt.zero_grad()
    backward(model, x, y)
    p = model[3].weight  # Linear(216, 16)
    p.data = randn((16 * 216,), device=device)
    p.grad = None
    params = [q for q in model.parameters() if q is not p]
    snap = snapshot_opt(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] changed shape from \(16, 216\) "
                                         r"to \(3456,\)"):
        opt.step()
    assert_opt_unchanged(opt, params, snap, "refused step")


@pytest.mark.cuda
def test_module_to_device_after_a_step_is_followed():
    model, opt = _trained("cpu")
    ref_model, ref = _reference_after(model, opt, lambda m: m.to("cuda"))
    held, copies = _old_storages(model)
    model.to("cuda")
    for x, y in batches(2, "cuda"):
        _step(model, opt, x, y)
        copy_grads(model.parameters(), ref_model.parameters())
        ref.step()
    _assert_untouched(held, copies, model)
    assert all(opt.state[p]["exp_avg"].device.type == "cuda" for p in model.parameters())
    assert_params_match(model.parameters(), ref_model.parameters(), atol_rel=0)


def test_load_state_dict_with_assign_is_refused_at_the_next_step(device):
    model, opt = _trained(device)
    new_weights = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(new_weights, assign=True)
    x, y = batches(1, device)[0]
    opt.zero_grad()
    backward(model, x, y)
    with pytest.raises(RuntimeError, match=r"replaced Conv2d.weight \(shape \(6, 3, 3, 3\)\) by a new Parameter"):
        opt.step()


@pytest.mark.parametrize("grad_dtype", [F32, BF16])
def test_grad_data_replaced_is_read_where_it_now_lives(device, grad_dtype):
    model, opt = _trained(device)
    other = clone_model(model)
    oopt = FusedAdam(other.parameters(), **HYPER)
    oopt.load_state_dict(opt.state_dict())
    x, y = batches(1, device)[0]
    for m, o in ((model, opt), (other, oopt)):
        o.zero_grad()
        backward(m, x, y)
    replaced = [randn(p.shape, device=device).to(grad_dtype) for p in model.parameters()]
    held = [p.grad.data for p in model.parameters()]
    copies = [h.clone() for h in held]
    for p, q, g in zip(model.parameters(), other.parameters(), replaced):
        p.grad.data = g  # same gradient object, other memory (and dtype)
        q.grad = g.float()
    opt.step()
    oopt.step()
    if device == "cuda" and grad_dtype == BF16:
        # The GPU runs fp32 params with bf16 gradients through a kernel of
        # their own, whose fused multiply-adds may round 1 ulp apart.
        assert_params_match(model.parameters(), other.parameters(), atol_rel=1e-7)
    else:
        for i, (p, q) in enumerate(zip(model.parameters(), other.parameters())):
            assert_bits_equal(p, q, f"param[{i}]")
    for h, c in zip(held, copies):
        assert_bits_equal(h, c, "a replaced gradient was touched")


def test_grad_data_with_another_numel_is_refused_before_anything_changes(device):
    model, opt = _trained(device)
    x, y = batches(1, device)[0]
    opt.zero_grad()
    backward(model, x, y)
    params = list(model.parameters())
    params[4].grad.data = randn(3, device=device)  # Linear(16, 4).weight: 64 elements
    snap = snapshot_opt(opt, params)
    with pytest.raises(ValueError, match=r"the gradient of param_groups\[0\]\['params'\]\[4\] has 3 elements"):
        opt.step()
    assert_opt_unchanged(opt, params, snap, "refused step")


def _many_params(device, n=150):
    return [nn.Parameter(randn(5, device=device)) for _ in range(n)]


@pytest.mark.parametrize("how", ["new-tensor", "none", "data"])
def test_flat_grads_catch_one_replaced_gradient_at_that_step(device, how):
    params = _many_params(device)
    opt = FusedAdam(params, flat_grads=True, **HYPER)
    for _ in range(2):
        opt.zero_grad()
        sum((p * p).sum() for p in params).backward()
        opt.step()
    opt.zero_grad()
    sum((p * p).sum() for p in params).backward()
    target = params[137]  # far from the start: no rotating window reaches it in one step
    if how == "new-tensor":
        target.grad = target.grad.clone()
    elif how == "none":
        target.grad = None
    else:
        target.grad.data = target.grad.clone()
    snap = snapshot_opt(opt, params)
    with pytest.raises(RuntimeError, match=r"gradient of param_groups\[0\]\['params'\]\[137\] .* was "):
        opt.step()
    assert_opt_unchanged(opt, params, snap, "refused step")


@pytest.mark.parametrize("group_change, error", [
    ({"lr": float("nan")}, ValueError), ({"lr": float("inf")}, ValueError), ({"lr": "0.01"}, TypeError),
    ({"lr": -1.0}, ValueError), ({"betas": (0.9, float("inf"))}, ValueError), ({"betas": (1.0, 0.99)}, ValueError),
    ({"eps": -1e-8}, ValueError), ({"eps": float("nan")}, ValueError), ({"weight_decay": float("nan")}, ValueError),
])
def test_invalid_hyperparameters_refuse_the_step_before_anything_changes(device, group_change, error):
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam([{"params": params[:2]}, {"params": params[2:]}], **HYPER)
    x, y = batches(1, device)[0]
    _step(model, opt, x, y)
    opt.zero_grad()
    backward(model, x, y)
    opt.param_groups[1].update(group_change)
    snap = snapshot_opt(opt, params)
    name = next(iter(group_change))
    with pytest.raises(error, match=rf"param_groups\[1\]: {name}"):
        opt.step()
    assert_opt_unchanged(opt, params, snap, "refused step")


def test_step_bumps_the_version_of_saved_parameters_like_torch(device):
    """autograd sees the step's in-place write: a backward through a graph
    that saved the parameter before the step raises, as with torch.optim."""
    for make_opt in (lambda ps: FusedAdam(ps, **HYPER), lambda ps: torch.optim.AdamW(ps, **HYPER)):
        w = nn.Parameter(randn((4, 4), device=device))
        opt = make_opt([w])
        x = randn((3, 4), device=device, scale=1.0).requires_grad_()
        (x @ w).sum().backward(retain_graph=False)
        opt.step()
        x2 = randn((3, 4), device=device).requires_grad_()
        loss = (x2 @ w).sum()  # saves w for the gradient of x2
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("device, capturable", [
    ("cpu", False), pytest.param("cuda", False, marks=pytest.mark.cuda),
    pytest.param("cuda", True, marks=pytest.mark.cuda)])
def test_nonfinite_gradients_skip_the_step_when_asked(device, capturable):
    """skip_nonfinite_grads: an inf gradient skips the step bit for bit and is counted."""
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam(params, skip_nonfinite_grads=True, capturable=capturable, **HYPER)
    x, y = batches(1, device)[0]
    _step(model, opt, x, y)
    opt.zero_grad()
    backward(model, x, y)
    params[3].grad[0] = float("inf")
    snap = snapshot_opt(opt, params)
    opt.step()
    assert_opt_unchanged(opt, params, snap, "skipped step")
    assert int(opt.skipped_steps) == 1
    _step(model, opt, x, y)
    assert int(opt.param_groups[0]["step"]) == 2, "a finite step after the skip is taken"
    assert all(bool(torch.isfinite(p).all()) for p in params)
