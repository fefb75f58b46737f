"""Every load refuses a bad state dict before writing anything.

FusedAdam.load_state_dict and DistributedFusedAdam.load_state_dict (one gloo
rank in this process) run the same checks (shardadam/_state_dict_check.py) on
every accepted format: shardadam's own (FusedAdam's ``master_param``),
DistributedFusedAdam's portable one (``param``) and torch.optim.AdamW's (a
step per parameter). For each broken dict: a ValueError naming what is wrong,
and afterwards the parameters, every state tensor, the groups'
hyperparameters and step counters bit-identical to before, and the caller's
dict untouched (no tensor of it written, no key added or removed)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from conftest import assert_bits_equal
from test_fused_adam_helpers import BF16, F32, assert_opt_unchanged, backward, batches, make_model, snapshot_opt

# ---------------------------------------------------------------- the dicts


def _fused_groups(model):
    return [dict(params=list(model[0].parameters())),
            dict(params=list(model[3].parameters()) + list(model[5].parameters()), lr=3e-3, betas=(0.8, 0.99))]


def _train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        backward(model, x, y)
        opt.step()


def _renamed(sd: dict, old: str, new: str) -> dict:
    out = copy.deepcopy(sd)
    for entry in out["state"].values():
        if old in entry:
            entry[new] = entry.pop(old)
    return out


def _torch_dict(model_fn, groups_fn, data_fn, train_fn):
    """A torch.optim.AdamW state dict of the same model (per-parameter step)."""
    model = model_fn()
    opt = torch.optim.AdamW(groups_fn(model), lr=1e-3, weight_decay=0.05, foreach=False)
    train_fn(model, opt, data_fn())
    return opt.state_dict()


def _fused_setup(fmt: str):
    """A trained FusedAdam and a loadable dict in format fmt."""
    dtype = F32 if fmt == "torch" else BF16
    model = make_model("cpu", dtype)
    opts = dict(master_weights=True) if dtype == BF16 else {}
    opt = shardadam.FusedAdam(_fused_groups(model), lr=1e-3, weight_decay=0.05, **opts)
    _train(model, opt, batches(2, "cpu", dtype))
    if fmt == "fused":
        sd = opt.state_dict()
    elif fmt == "distributed":
        sd = _renamed(opt.state_dict(), "master_param", "param")
    else:
        sd = _torch_dict(lambda: make_model(), _fused_groups, lambda: batches(2), _train)
    return model, opt, sd


# ---------------------------------------------------------------- breakers


def _tampered(sd: dict) -> dict:
    """Every value differs from the optimizer's, so that a partial load would show."""
    bad = copy.deepcopy(sd)
    for g in bad["param_groups"]:
        g["lr"], g["weight_decay"] = 0.5, 0.25
        if "step" in g:
            g["step"] = 99
    for entry in bad["state"].values():
        for k, v in entry.items():
            entry[k] = v * 2 + 1 if k != "step" else v + 90
    return bad


def _first(sd: dict) -> dict:
    """The state entry of group 0's first parameter (a weight of 2 or more dims)."""
    return sd["state"][sd["param_groups"][0]["params"][0]]


def _set_step(sd: dict, value) -> None:
    """The step counter where this format keeps it: the group, or each parameter (torch)."""
    if "step" in sd["param_groups"][0]:
        sd["param_groups"][0]["step"] = value
    else:
        _first(sd)["step"] = torch.tensor(value) if isinstance(value, float) else value


def _both_masters(sd):
    e = _first(sd)
    e["param"] = e["exp_avg"].clone()
    e["master_param"] = e["exp_avg"].clone()


def _replace(name: str, fn):
    def breaker(sd):
        e = _first(sd)
        e[name] = fn(e[name])
    return breaker


def _group(key: str, value):
    def breaker(sd):
        sd["param_groups"][0][key] = value
    return breaker


def _stray(sd):
    sd["state"][12345] = copy.deepcopy(_first(sd))


def _duplicate(sd):
    sd["param_groups"][1]["params"][0] = sd["param_groups"][0]["params"][0]


class _Instead:
    """A breaker's replacement for the whole dict."""

    def __init__(self, value):
        self.value = value


# name: (breaker (may return _Instead(replacement)), words the message must hold)
CASES = {
    "not-a-dict": (lambda sd: _Instead(list(sd.items())), ["state_dict must be", "list"]),
    "no-state": (lambda sd: sd.pop("state"), ["'state'", "needs"]),
    "groups-not-a-list": (lambda sd: sd.update(param_groups={0: sd["param_groups"][0]}), ["'param_groups']", "list"]),
    "state-not-a-dict": (lambda sd: sd.update(state=list(sd["state"].values())), ["state_dict['state']", "dict"]),
    "group-not-a-dict": (lambda sd: sd["param_groups"].__setitem__(0, "lr"), ["['param_groups'][0]", "'params'"]),
    "group-without-params": (lambda sd: sd["param_groups"][0].pop("params"), ["['param_groups'][0]", "'params'"]),
    "fewer-groups": (lambda sd: sd["param_groups"].pop(), ["parameter groups"]),
    "parameter-count": (lambda sd: sd["param_groups"][1]["params"].pop(), ["group 1", "parameters"]),
    "duplicate-key": (_duplicate, ["['param_groups'][1]['params'][0]", "lists too"]),
    "stray-state": (_stray, ["12345", "no group"]),
    "entry-not-a-dict": (lambda sd: sd["state"].__setitem__(sd["param_groups"][0]["params"][0], torch.zeros(3)),
                         ["must be a dict"]),
    "unknown-state": (lambda sd: _first(sd).__setitem__("momentum_buffer", _first(sd)["exp_avg"].clone()),
                      ["'momentum_buffer'"]),
    "both-masters": (_both_masters, ["'master_param' and 'param'"]),
    "missing-exp_avg_sq": (lambda sd: _first(sd).pop("exp_avg_sq"), ["'exp_avg_sq'", "has no"]),
    "not-a-tensor": (_replace("exp_avg", lambda t: t.tolist()), ["['exp_avg']", "torch.Tensor", "list"]),
    "sparse": (_replace("exp_avg", lambda t: t.to_sparse()), ["['exp_avg']", "sparse"]),
    "meta": (_replace("exp_avg", lambda t: torch.empty_like(t, device="meta")), ["['exp_avg']", "meta"]),
    "complex": (_replace("exp_avg", lambda t: t.to(torch.complex64)), ["['exp_avg']", "complex64"]),
    "integer": (_replace("exp_avg_sq", lambda t: t.to(torch.int32)), ["['exp_avg_sq']", "int32"]),
    "bool": (_replace("exp_avg", lambda t: t > 0), ["['exp_avg']", "bool"]),
    "other-shape-same-numel": (_replace("exp_avg", lambda t: t.reshape(-1)), ["['exp_avg']", "shape"]),
    "lr-inf": (_group("lr", math.inf), ["['param_groups'][0]", "lr", "finite"]),
    "lr-nan": (_group("lr", math.nan), ["lr", "finite"]),
    "lr-negative": (_group("lr", -1e-3), ["lr", ">= 0"]),
    "lr-string": (_group("lr", "0.001"), ["lr", "number"]),
    "lr-meta-tensor": (_group("lr", torch.empty((), device="meta")), ["lr", "meta"]),
    "beta-one": (_group("betas", (0.9, 1.0)), ["betas[1]", "[0, 1)"]),
    "betas-three": (_group("betas", (0.9, 0.99, 0.999)), ["betas", "pair"]),
    "eps-negative": (_group("eps", -1e-8), ["eps", ">= 0"]),
    "weight_decay-nan": (_group("weight_decay", math.nan), ["weight_decay", "finite"]),
    "bias_correction-string": (_group("bias_correction", "yes"), ["bias_correction", "True or False"]),
    "step-negative": (lambda sd: _set_step(sd, -1), ["step", "whole number"]),
    "step-fraction": (lambda sd: _set_step(sd, 2.5), ["step", "whole number"]),
    "step-nan": (lambda sd: _set_step(sd, math.nan), ["step", "finite"]),
    "step-bool": (lambda sd: _set_step(sd, True), ["step", "number"]),
}


def _broken(sd: dict, case: str) -> dict:
    bad = _tampered(sd)
    out = CASES[case][0](bad)
    return out.value if isinstance(out, _Instead) else bad


def _fingerprint(obj):
    """The structure of a (state) dict and, for tensors, their identity and
    version counter: an in-place write into a tensor bumps its version."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), obj._version, obj.dtype, tuple(obj.shape), str(obj.device), str(obj.layout))
    if isinstance(obj, dict):
        return ("dict", [(repr(k), _fingerprint(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [_fingerprint(v) for v in obj])
    return ("value", repr(obj))


def _assert_refused(load, bad, case: str) -> None:
    before = _fingerprint(bad)
    with pytest.raises(ValueError) as info:
        load(bad)
    for word in CASES[case][1]:
        assert word in str(info.value), f"{case}: the message {str(info.value)!r} does not name {word!r}"
    assert _fingerprint(bad) == before, f"{case}: the caller's dict was modified"


def _hyper(opt) -> list:
    return [{k: v for k, v in g.items() if k not in ("params", "step")} for g in opt.param_groups]


# ---------------------------------------------------------------- FusedAdam


@pytest.mark.parametrize("fmt", ["fused", "distributed", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_adam_refuses_and_changes_nothing(fmt, case):
    model, opt, good = _fused_setup(fmt)
    bad = _broken(good, case)
    params = list(model.parameters())
    before, hyper = snapshot_opt(opt, params), _hyper(opt)
    _assert_refused(opt.load_state_dict, bad, case)
    assert_opt_unchanged(opt, params, before, f"FusedAdam after a refused load ({fmt}, {case})")
    assert _hyper(opt) == hyper, "the groups' hyperparameters changed"
    opt.load_state_dict(good)  # the unbroken dict still loads
    assert opt.param_groups[1]["lr"] == 3e-3 or fmt == "torch"


# ---------------------------------------------------------------- DistributedFusedAdam (one rank)


def _dist_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))


def _dist_groups(model):
    return [dict(params=[model[0].weight, model[2].weight]),
            dict(params=[model[0].bias, model[2].bias], lr=3e-3, weight_decay=0.0)]


def _dist_data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for _ in range(2)]


def _dist_train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _dist_setup(fmt: str):
    model = _dist_model()
    opt = shardadam.DistributedFusedAdam(_dist_groups(model), lr=1e-3, weight_decay=0.05, bucket_cap_mb=1e-4,
                                         overlap_grad_sync=False)
    _dist_train(model, opt, _dist_data())
    if fmt == "distributed":
        sd = opt.state_dict()
    elif fmt == "fused":
        sd = _renamed(opt.state_dict(), "param", "master_param")
    else:
        sd = _torch_dict(_dist_model, _dist_groups, _dist_data, _dist_train)
    return model, opt, sd


def dist_snapshot(opt, model) -> dict:
    """Bit-exact copies of everything a load could write in a DistributedFusedAdam."""
    buffers = {n: getattr(opt, n).clone() for n in ("master", "remainders") if getattr(opt, n) is not None}
    buffers.update({f"{n} {i}": t.clone() for n in ("param_shards", "grad_shards")
                    for i, t in enumerate(getattr(opt, n).tensors)})
    buffers.update({n: t.clone() for n, t in opt.states.items()})
    return dict(buffers=buffers,
                scales={n: t.clone() for n, t in opt.state_scales.items()},
                params=[p.detach().clone() for p in model.parameters()],
                groups=[{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
                        for g in opt.param_groups],
                initialized=list(opt._initialized))


def assert_dist_unchanged(opt, model, snap: dict, what: str) -> None:
    now = dist_snapshot(opt, model)
    for name, value in snap["buffers"].items():
        assert_bits_equal(now["buffers"][name], value, f"{what}: {name}")
    for name, value in snap["scales"].items():
        assert_bits_equal(now["scales"][name], value, f"{what}: {name} scales")
    for i, (p, q) in enumerate(zip(now["params"], snap["params"])):
        assert_bits_equal(p, q, f"{what}: param {i}")
    assert now["groups"] == snap["groups"], f"{what}: group values or step counters changed"
    assert now["initialized"] == snap["initialized"], f"{what}: initialisation flags changed"


@pytest.mark.parametrize("fmt", ["distributed", "fused", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_distributed_fused_adam_refuses_and_changes_nothing(one_rank, fmt, case):
    model, opt, good = _dist_setup(fmt)
    bad = _broken(good, case)
    before = dist_snapshot(opt, model)
    _assert_refused(opt.load_state_dict, bad, case)
    assert_dist_unchanged(opt, model, before, f"DistributedFusedAdam after a refused load ({fmt}, {case})")
    opt.load_state_dict(good)  # the unbroken dict still loads


def test_amsgrad_optimizer_refuses_a_dict_without_max_exp_avg_sq():
    """Both optimizers keep max_exp_avg_sq with AMSGrad: a checkpoint without
    it is refused, where FusedAdam used to keep its old values silently."""
    model = make_model()
    opt = shardadam.FusedAdam(_fused_groups(model), amsgrad=True)
    _train(model, opt, batches(2))
    sd = {k: copy.deepcopy(v) for k, v in opt.state_dict().items()}
    for entry in sd["state"].values():
        entry.pop("max_exp_avg_sq")
    params = list(model.parameters())
    before = snapshot_opt(opt, params)
    with pytest.raises(ValueError, match="has no 'max_exp_avg_sq'"):
        opt.load_state_dict(sd)
    assert_opt_unchanged(opt, params, before, "FusedAdam(amsgrad=True)")


def test_devices_and_dtypes_that_copy_are_accepted():
    """Real floating tensors of any precision load (they are copied): a
    float64 checkpoint equals its float32 one."""
    model, opt, sd = _fused_setup("torch")
    wide = copy.deepcopy(sd)
    for entry in wide["state"].values():
        for k in ("exp_avg", "exp_avg_sq"):
            entry[k] = entry[k].double()
    opt.load_state_dict(wide)
    narrow = opt.state_dict()
    opt.load_state_dict(sd)
    for k, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            assert_bits_equal(narrow["state"][k][name], value, f"state {k} {name}")
