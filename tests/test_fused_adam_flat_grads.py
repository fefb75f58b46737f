"""FusedAdam(flat_grads=True): gradients live in the optimizer's flat buffers."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import assert_bits_equal, randn
from shardadam import FusedAdam
from test_fused_adam_helpers import (assert_opt_unchanged, assert_params_match, assert_states_match, backward,
                                     batches, clone_model, copy_grads, fp32_copies, make_model, snapshot_opt)

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
STEPS = 10


def _assert_one_storage(params):
    ptrs = {p.grad.untyped_storage().data_ptr() for p in params}
    assert len(ptrs) == 1, f"gradients live in {len(ptrs)} storages, not one"
    starts = [p.grad.data_ptr() for p in params]
    assert len(set(starts)) == len(starts), "two gradients share their first element"
    assert all(p.grad._base is not None for p in params), "gradients are not views"


def test_flat_grads_equal_regular_grads(device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    model = make_model(device)
    other = clone_model(model)
    params = list(model.parameters())
    opt = FusedAdam(params, flat_grads=True, **HYPER)
    oopt = FusedAdam(other.parameters(), **HYPER)
    for s, (x, y) in enumerate(batches(STEPS, device), 1):
        for m, o in ((model, opt), (other, oopt)):
            o.zero_grad()
            backward(m, x, y)
            o.step()
        if s == 1:
            _assert_one_storage(params)
            grads = [p.grad for p in params]
        else:  # backward accumulated into the same views
            assert all(p.grad is g for p, g in zip(params, grads)), f"step {s}: gradient objects replaced"
    if device == "cpu":
        for i, (p, q) in enumerate(zip(params, other.parameters())):
            assert_bits_equal(p, q, f"param[{i}]")
        for i, (p, q) in enumerate(zip(params, other.parameters())):
            for k in ("exp_avg", "exp_avg_sq"):
                assert_bits_equal(opt.state[p][k], oopt.state[q][k], f"state[{i}]['{k}']")
    else:
        assert_params_match(params, other.parameters(), atol_rel=1e-6)


def test_flat_grads_zero_grad_zeroes_in_place(device):
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam(params, flat_grads=True, **HYPER)
    x, y = batches(1, device)[0]
    opt.zero_grad()
    backward(model, x, y)
    opt.step()
    grads = [p.grad for p in params]
    assert all(bool((g != 0).any()) for g in grads)
    for set_to_none in (True, False):  # set_to_none is ignored
        backward(model, x, y)
        opt.zero_grad(set_to_none=set_to_none)
        assert all(p.grad is g for p, g in zip(params, grads)), "zero_grad replaced the gradient views"
        assert all(bool((g == 0).all()) for g in grads), "zero_grad left nonzero gradients"
    _assert_one_storage(params)


def test_flat_grads_params_without_grad_take_a_zero_gradient_step(device):
    """Documented: with flat_grads every param steps, with a zero gradient where
    backward gave none (unlike torch.optim, which skips it)."""
    model = make_model(device)
    unused = nn.Parameter(randn(11, device=device))
    mine = list(model.parameters()) + [unused]
    theirs = fp32_copies(mine)
    opt = FusedAdam(mine, flat_grads=True, **HYPER)
    topt = torch.optim.AdamW(theirs, foreach=False, **HYPER)
    for x, y in batches(5, device):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(mine[:-1], theirs[:-1])
        theirs[-1].grad = torch.zeros_like(theirs[-1])
        opt.step()
        topt.step()
    assert unused.grad is not None and bool((unused.grad == 0).all())
    assert_params_match(mine, theirs)
    assert_states_match(opt, mine, topt, theirs)


def test_flat_grads_model_zero_grad_then_step_raises(device):
    model = make_model(device)
    opt = FusedAdam(model.parameters(), flat_grads=True, **HYPER)
    data = batches(3, device)
    for x, y in data[:2]:
        opt.zero_grad()
        backward(model, x, y)
        opt.step()
    model.zero_grad()  # set_to_none: drops the views
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    backward(model, *data[2])  # new gradient tensors, not the views
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()


def test_flat_grads_failed_step_changes_nothing(device):
    """The step that raises after model.zero_grad() leaves params, states and
    the step counter as they were."""
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam(params, flat_grads=True, **HYPER)
    for x, y in batches(2, device):
        opt.zero_grad()
        backward(model, x, y)
        opt.step()
    model.zero_grad()
    before = snapshot_opt(opt, params)
    with pytest.raises(RuntimeError):
        opt.step()
    assert_opt_unchanged(opt, params, before, "after the failed flat_grads step")


def test_flat_grads_bf16_master_equal_regular(device):
    """flat_grads with bf16 params and fp32 masters: same masters as without."""
    model = make_model(device, torch.bfloat16)
    other = clone_model(model)
    params, oparams = list(model.parameters()), list(other.parameters())
    opt = FusedAdam(params, flat_grads=True, master_weights=True, **HYPER)
    oopt = FusedAdam(oparams, master_weights=True, **HYPER)
    for x, y in batches(6, device, torch.bfloat16):
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(params, oparams)
        opt.step()
        oopt.step()
    _assert_one_storage(params)
    assert params[0].grad.dtype == torch.bfloat16
    for i, (p, q) in enumerate(zip(params, oparams)):
        assert_bits_equal(opt.state[p]["master_param"], oopt.state[q]["master_param"], f"master[{i}]")
        assert_bits_equal(p, q, f"bf16 param[{i}]")
