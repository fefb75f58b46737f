"""Copies of an optimizer object ([Note: copies of an optimizer] in
_optimizer_copies.py): copy.deepcopy, pickle and torch.save give a working
FusedAdam / FusedLion whose training equals, bit for bit, the original's
going on uncopied; the original is untouched by the copy's steps.
DistributedFusedAdam refuses to be copied, and stays as it was."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist

import shardadam
from conftest import assert_bits_equal, saved_steps

KINDS = {
    "fp32": (shardadam.FusedAdam, dict(weight_decay=0.01), torch.float32),
    "8-bit-amsgrad": (shardadam.FusedAdam, dict(amsgrad=True, exp_avg_dtype=shardadam.BLOCKWISE8,
                                                exp_avg_sq_dtype=shardadam.BLOCKWISE8), torch.float32),
    "bf16-masters": (shardadam.FusedAdam, dict(master_weights=True), torch.bfloat16),
    "bf16-remainders": (shardadam.FusedAdam, dict(store_param_remainders=True), torch.bfloat16),
    "lion-bf16-state": (shardadam.FusedLion, dict(exp_avg_dtype=torch.bfloat16), torch.float32),
}


def _model(device, dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device, dtype)


def _train(model, opt, seeds, scheduler=None):
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 8, generator=g).to(next(model.parameters()))
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _values(model, opt):
    return [p.detach().clone() for p in model.parameters()] + \
        [v.clone() for s in opt.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bits_equal(a, b, f"value {i}")


def _through_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def _through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a whole object: not a weights-only file


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", [copy.deepcopy, _through_pickle, _through_torch_save],
                         ids=["deepcopy", "pickle", "torch.save"])
def test_a_copy_trains_as_the_original_would(device, kind, how):
    cls, options, dtype = KINDS[kind]
    model, twin = _model(device, dtype), _model(device, dtype)
    opt, twin_opt = cls(model.parameters(), lr=1e-2, **options), cls(twin.parameters(), lr=1e-2, **options)
    _train(model, opt, [1, 2])
    _train(twin, twin_opt, [1, 2])
    opt.param_groups[0]["lr"] = 5e-3  # a group value set after construction comes over too
    twin_opt.param_groups[0]["lr"] = 5e-3
    before = _values(model, opt)
    copied_model, copied_opt = how((model, opt))
    assert type(copied_opt) is cls
    assert all(p is q for p, q in zip(copied_opt.param_groups[0]["params"], copied_model.parameters()))
    _train(copied_model, copied_opt, [3, 4])
    _assert_same(_values(model, opt), before)  # the copy's steps left the original alone
    _train(twin, twin_opt, [3, 4])
    _assert_same(_values(copied_model, copied_opt), _values(twin, twin_opt))
    _train(model, opt, [3, 4])  # and the original trains on as if never copied
    _assert_same(_values(model, opt), _values(twin, twin_opt))


def test_a_shallow_copy_has_its_own_state():
    """copy.copy: a second optimizer over the same parameters, with the
    original's state as its own copy."""
    model = _model("cpu", torch.float32)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2)
    _train(model, opt, [1])
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    other = copy.copy(opt)
    assert other.param_groups[0]["params"][0] is model[0].weight
    _train(model, other, [2])
    for name, value in opt.state[model[0].weight].items():
        assert_bits_equal(value, state[name], name)
    assert saved_steps(other.state_dict()) == [2] and saved_steps(opt.state_dict()) == [1]


def test_a_copy_keeps_skipped_steps():
    model = _model("cpu", torch.float32)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, skip_nonfinite_grads=True)
    _train(model, opt, [1])
    model[0].weight.grad.fill_(float("nan"))
    opt.step()
    assert opt.skipped_steps == 1
    assert copy.deepcopy(opt).skipped_steps == 1


@pytest.mark.cuda
def test_a_capturable_copy_trains_as_the_original_would():
    model, twin = _model("cuda", torch.float32), _model("cuda", torch.float32)
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    twin_opt = shardadam.FusedAdam(twin.parameters(), lr=1e-2, capturable=True)
    _train(model, opt, [1, 2])
    _train(twin, twin_opt, [1, 2])
    copied_model, copied_opt = copy.deepcopy((model, opt))
    assert copied_opt.param_groups[0]["lr"].device.type == "cuda"
    _train(copied_model, copied_opt, [3])
    _train(twin, twin_opt, [3])
    _assert_same(_values(copied_model, copied_opt), _values(twin, twin_opt))


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, _through_pickle], ids=["copy", "deepcopy", "pickle"])
def test_distributed_optimizer_refuses_to_be_copied(how):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model("cpu", torch.float32)
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2)
        _train(model, opt, [1])
        before = _values(model, opt)
        with pytest.raises(TypeError, match=r"DistributedFusedAdam cannot be copied or pickled: .* Save "
                                            r"opt.state_dict\(\) \(or sharded_state_dict\(\)\) and load it"):
            how(opt)
        _assert_same(_values(model, opt), before)
        _train(model, opt, [2])  # still trains
    finally:
        dist.destroy_process_group()
