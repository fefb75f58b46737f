"""FusedAdam checkpoints: mid-training round trips, loads across state dtypes
and master storage, the caller's dict left alone, mismatches rejected before
anything is written."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_bits_equal, saved_steps
import shardadam
from shardadam import FusedAdam
from test_fused_adam_helpers import (BF16, F16, F32, assert_nested_equal, assert_opt_unchanged,
                                     assert_state_dicts_bit_equal, backward, batches, clone_model, close, copy_grads,
                                     make_model, snapshot_opt, true_state)

ULP = {F32: 2.0 ** -23, BF16: 2.0 ** -7, F16: 2.0 ** -10}
BASE = dict(lr=1e-3, weight_decay=0.05)

# name: (param dtype, FusedAdam options)
ROUND_TRIP = {
    "fp32": (F32, {}),
    "fp32-amsgrad-l2": (F32, dict(amsgrad=True, adam_w_mode=False)),
    "bf16-master": (BF16, dict(master_weights=True)),
    "bf16-remainders": (BF16, dict(store_param_remainders=True)),
    "fp16-states": (F32, dict(exp_avg_dtype=F16, exp_avg_sq_dtype=F16, amsgrad=True)),
    "bf16-states": (F32, dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    "bf16-master-fp16-states": (BF16, dict(master_weights=True, exp_avg_dtype=F16, exp_avg_sq_dtype=F16)),
}


def _groups(model, lr):
    """Two groups with different hyperparameters."""
    return [dict(params=list(model[0].parameters())),
            dict(params=list(model[3].parameters()) + list(model[5].parameters()), lr=3 * lr, betas=(0.8, 0.99))]


def _train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        backward(model, x, y)
        opt.step()


def _assert_same_run(model, opt, other, other_opt, device, dtype):
    """Bit for bit on the CPU; on CUDA (convolution backward may sum in another
    order) within fp32 parity, 16-bit params within one rounding."""
    if device == "cpu":
        for i, (p, q) in enumerate(zip(model.parameters(), other.parameters())):
            assert_bits_equal(p, q, f"param[{i}]")
        assert_state_dicts_bit_equal(other_opt.state_dict(), opt.state_dict())
        return
    sd, osd = opt.state_dict(), other_opt.state_dict()
    assert osd["param_groups"] == sd["param_groups"]
    tol = 1e-6 if dtype == F32 else 1e-5
    for i, st in sd["state"].items():
        for k, v in st.items():
            close(osd["state"][i][k], v, f"state[{i}]['{k}']", rtol=tol, atol_rel=tol)
    for i, (p, q) in enumerate(zip(model.parameters(), other.parameters())):
        close(q.float(), p.float(), f"param[{i}]", rtol=ULP[dtype], atol_rel=ULP[dtype])


@pytest.mark.parametrize("config", list(ROUND_TRIP))
def test_round_trip_mid_training(device, config, monkeypatch):
    """Train 5 steps, save, rebuild model and optimizer (with other
    hyperparameters, which the load restores), load, train 5 more: identical to
    the uninterrupted run. The saved dict is never modified."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    dtype, opts = ROUND_TRIP[config]
    model = make_model(device, dtype)
    opt = FusedAdam(_groups(model, 1e-3), **BASE, **opts)
    data = batches(10, device, dtype)
    _train(model, opt, data[:5])
    sd = copy.deepcopy(opt.state_dict())  # as torch.save / torch.load would
    model_sd = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(sd)
    assert saved_steps(sd) == [5, 5]
    _train(model, opt, data[5:])  # the uninterrupted run

    torch.manual_seed(1234)
    fresh = make_model(device, dtype)  # other initial values, overwritten by the checkpoint
    fresh.load_state_dict(model_sd)
    fopt = FusedAdam(_groups(fresh, 0.5), lr=0.5, weight_decay=0.0, betas=(0.5, 0.5), eps=1e-3, **opts)
    fopt.load_state_dict(sd)
    assert_nested_equal(sd, saved, "state dict after load_state_dict")
    groups = fopt.param_groups
    assert [g["lr"] for g in groups] == [1e-3, 3e-3] and [g["step"] for g in groups] == [5, 5]
    assert [g["betas"] for g in groups] == [(0.9, 0.999), (0.8, 0.99)] and groups[0]["weight_decay"] == 0.05
    _train(fresh, fopt, data[5:])
    assert_nested_equal(sd, saved, "state dict after training on from it")
    _assert_same_run(model, opt, fresh, fopt, device, dtype)


STATE_DTYPE_LOADS = {
    "f32-to-bf16": (dict(), dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    "bf16-to-f32": (dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), dict()),
    "f32-to-f16": (dict(), dict(exp_avg_dtype=F16, exp_avg_sq_dtype=F16)),
    "f16-to-f32": (dict(exp_avg_dtype=F16, exp_avg_sq_dtype=F16), dict()),
    "f16-to-bf16": (dict(exp_avg_dtype=F16, exp_avg_sq_dtype=F16), dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
}


@pytest.mark.parametrize("case", list(STATE_DTYPE_LOADS))
def test_load_across_state_dtypes(device, case):
    save_opts, load_opts = STATE_DTYPE_LOADS[case]
    model = make_model(device)
    opt = FusedAdam(model.parameters(), **BASE, **save_opts)
    data = batches(7, device)
    _train(model, opt, data[:4])
    sd = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(sd)
    fresh = clone_model(model)
    fopt = FusedAdam(fresh.parameters(), **BASE, **load_opts)
    fopt.load_state_dict(sd)
    assert_nested_equal(sd, saved, "state dict after load_state_dict")
    for i, p in enumerate(fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            dt = load_opts.get(key + "_dtype", F32)
            st = fopt.state[p]
            assert st[key].dtype == dt
            want = sd["state"][i][key]
            got = true_state(fopt, p, key)
            if dt == F32:
                assert_bits_equal(got, want, f"{key}[{i}] loaded into fp32")
            elif dt == BF16:  # round to nearest: within half a bf16 ulp
                close(got, want, f"{key}[{i}] loaded into bf16", rtol=2.0 ** -8, atol_rel=0.0)
            else:  # fp16 with a scale: half an fp16 ulp, or of its subnormal step
                scale = st[key + "_scale"].item()
                amax = st[key].float().abs().max().item()
                assert 2.0 ** 14 <= amax <= 2.0 ** 15, f"loaded {key}[{i}] stored amax {amax}"
                close(got, want, f"{key}[{i}] loaded into fp16", rtol=2.0 ** -11, atol_rel=2.0 ** -25,
                      magnitude=1.0 / scale)
        if save_opts.get("exp_avg_dtype") == BF16:  # saved bf16 values are exactly representable
            w = sd["state"][i]["exp_avg"]
            assert_bits_equal(w.to(BF16).float(), w, "saved bf16 exp_avg")
    # Training goes on and stays with the uninterrupted run, within the rounding of the states.
    p_before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, data[4:])
    _train(fresh, fopt, data[4:])
    unit = max(ULP[save_opts.get("exp_avg_dtype", F32)], ULP[load_opts.get("exp_avg_dtype", F32)])
    for i, (p, q, p0) in enumerate(zip(model.parameters(), fresh.parameters(), p_before)):
        moved = p.detach() - p0
        assert moved.abs().max().item() > 1e-4
        close(q.detach() - p0, moved, f"param[{i}] update after the load", rtol=0, atol_rel=8 * unit)


@pytest.mark.parametrize("direction", ["master-to-remainders", "remainders-to-master"])
def test_masters_load_across_storage(device, direction):
    """A bf16 checkpoint's fp32 masters load exactly into the other storage."""
    src_opts, dst_opts = dict(master_weights=True), dict(store_param_remainders=True)
    if direction == "remainders-to-master":
        src_opts, dst_opts = dst_opts, src_opts
    model = make_model(device, BF16)
    opt = FusedAdam(model.parameters(), **BASE, **src_opts)
    data = batches(6, device, BF16)
    _train(model, opt, data[:3])
    sd = copy.deepcopy(opt.state_dict())
    fresh = clone_model(model)
    fopt = FusedAdam(fresh.parameters(), **BASE, **dst_opts)
    fopt.load_state_dict(sd)
    back = fopt.state_dict()
    for i, st in sd["state"].items():
        assert_bits_equal(back["state"][i]["master_param"], st["master_param"], f"master[{i}]")
        assert not torch.equal(st["master_param"], st["master_param"].to(BF16).float())
    # And the next steps agree bit for bit given the same gradients (the bf16
    # params may differ: remainders round ties away from zero, masters to even).
    for x, y in data[3:]:
        opt.zero_grad()
        backward(model, x, y)
        copy_grads(model.parameters(), fresh.parameters())
        opt.step()
        fopt.step()
    a, b = opt.state_dict(), fopt.state_dict()
    for i in a["state"]:
        for k in a["state"][i]:
            assert_bits_equal(b["state"][i][k], a["state"][i][k], f"state[{i}]['{k}'] after training on")


# ---------------------------------------------------------------- mismatches

def _tampered(sd):
    """A copy in which every hyperparameter and state differs from the optimizer's,
    so that a partial load would show."""
    bad = copy.deepcopy(sd)
    for g in bad["param_groups"]:
        g["lr"], g["step"], g["weight_decay"] = 0.5, 99, 0.25
    for st in bad["state"].values():
        for k in st:
            st[k] = st[k] * 2 + 1
    return bad


def _break_group_count(bad):
    bad["param_groups"].pop()


def _break_param_count(bad):
    bad["param_groups"][1]["params"].pop()


def _break_shape(bad):
    last = max(bad["state"])
    bad["state"][last]["exp_avg_sq"] = torch.zeros(3, 3)


def _break_extra_group(bad):
    bad["param_groups"].append(dict(bad["param_groups"][0], params=[]))


MISMATCHES = {
    "fewer-groups": (_break_group_count, ["parameter groups"]),
    "more-groups": (_break_extra_group, ["parameter groups"]),
    "param-count": (_break_param_count, ["group 1", "parameters"]),
    "state-shape": (_break_shape, ["shape", "exp_avg_sq"]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_state_dict_rejected_and_changes_nothing(device, case):
    breaker, words = MISMATCHES[case]
    model = make_model(device)
    params = list(model.parameters())
    opt = FusedAdam(_groups(model, 1e-3), **BASE, amsgrad=True, exp_avg_dtype=F16, exp_avg_sq_dtype=F16)
    _train(model, opt, batches(2, device))
    bad = _tampered(opt.state_dict())
    breaker(bad)
    kept = copy.deepcopy(bad)
    before = snapshot_opt(opt, params)
    hyper_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(bad)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} does not name {w!r}"
    assert_opt_unchanged(opt, params, before, f"after a rejected load ({case})")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == hyper_before
    assert_nested_equal(bad, kept, "rejected state dict")
    # The untampered dict still loads.
    opt.load_state_dict(opt.state_dict())


def test_not_a_state_dict_rejected():
    model = make_model()
    opt = FusedAdam(model.parameters())
    with pytest.raises(ValueError, match="state dict"):
        opt.load_state_dict({"param_groups": []})


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("direction", ["torch-to-fused", "fused-to-torch"])
def test_torch_adamw_state_dicts_interchange(direction, amsgrad):
    """3 steps with one optimizer, its state dict into the other, 3 more: the
    same as 6 steps of torch AdamW (steps, moments and hyperparameters carried;
    torch keeps the step per parameter, FusedAdam per group)."""
    torch.manual_seed(0)
    model = make_model()
    data = batches(6)
    ref = clone_model(model)
    ref_opt = torch.optim.AdamW(_groups(ref, 1e-3), amsgrad=amsgrad, foreach=False, **BASE)
    _train(ref, ref_opt, data)
    first_cls = torch.optim.AdamW if direction == "torch-to-fused" else FusedAdam
    first_kw = dict(foreach=False) if first_cls is torch.optim.AdamW else {}
    first = first_cls(_groups(model, 1e-3), amsgrad=amsgrad, **first_kw, **BASE)
    _train(model, first, data[:3])
    sd = first.state_dict()
    if direction == "torch-to-fused":
        second = FusedAdam(_groups(model, 1e-3), amsgrad=amsgrad, lr=0.5, weight_decay=0.0)  # loaded over
    else:
        sd = shardadam.torch_adam_state_dict(sd)
        second = torch.optim.AdamW(_groups(model, 1e-3), amsgrad=amsgrad, foreach=False, lr=0.5, weight_decay=0.0)
    second.load_state_dict(sd)
    assert [g["lr"] for g in second.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    _train(model, second, data[3:])
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        close(p, q, f"param[{i}]")  # fp32 parity with torch, as the other AdamW comparisons
    if direction == "torch-to-fused":
        assert [g["step"] for g in second.param_groups] == [6, 6]
