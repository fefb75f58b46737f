"""The engine's forward hooks ([Note: hooks on the modules that own the
parameters] in distributed/_hooks.py): overlap_param_sync hooks the modules
that own the optimizer's parameters, not every module (so torch.compile
does not warn about global hooks), and falls back to the global hook where
an owner is unknown. One gloo rank in this process."""
from __future__ import annotations

import gc
import warnings

import torch
import torch.nn as nn

import shardadam
from shardadam.distributed._hooks import owning_modules


def _stepped(model: nn.Module, params=None):
    """An overlap_param_sync optimizer after one step: its all-gathers are
    owed to the next forward; the modules whose forward waited are recorded."""
    opt = shardadam.DistributedFusedAdam(params if params is not None else model.parameters(), lr=1e-2,
                                         overlap_param_sync=True)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.waited = []
    make_current = opt._make_current
    opt._make_current = lambda params: (opt.waited.append([tuple(p.shape) for p in params]), make_current(params))
    return opt


def test_compiling_a_model_with_overlap_param_sync_warns_nothing(one_rank):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    opt = _stepped(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager")
        compiled(torch.randn(3, 4)).sum().backward()
        opt.step()
        compiled(torch.randn(3, 4))
    assert not [str(w.message) for w in caught if "global hooks" in str(w.message)]
    assert opt.waited, "the compiled model's modules waited for their parameters"


def test_only_the_owning_modules_wait(one_rank):
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    other = nn.Sequential(nn.Linear(4, 3))
    opt = _stepped(model)
    other(torch.randn(3, 4))
    assert opt.waited == [], "a module of another model waited"
    model(torch.randn(3, 4))
    assert opt.waited[0] == [(8, 4), (8,)]  # the first Linear, before its forward; the rest landed with it


def test_modules_of_unknown_owners_fall_back_to_the_global_hook(one_rank):
    """Parameters no module registered (a plain list): every module's
    forward waits, as before; the hook goes with the optimizer."""
    params = [nn.Parameter(torch.randn(4, 2))]
    model = nn.Linear(4, 2)
    loose = nn.Module()
    loose.forward = lambda x: x @ params[0]
    assert owning_modules(params) is None
    opt = _stepped(loose, params)
    model(torch.randn(3, 4))
    assert opt.waited == [[(2, 4), (2,)]], "the global hook waited before an unrelated module's forward"
    del opt
    gc.collect()
    model(torch.randn(3, 4))  # no optimizer left to call: the hook was removed


def test_owning_modules_follow_registration():
    shared = nn.Linear(4, 4)
    tied = nn.Linear(4, 4)
    tied.weight = shared.weight  # a weight two modules hold
    assert set(map(id, owning_modules([shared.weight]))) == {id(shared), id(tied)}
    assert set(map(id, owning_modules([shared.weight, shared.bias, tied.bias]))) == {id(shared), id(tied)}
    old = tied.bias
    tied.bias = nn.Parameter(torch.zeros(4))  # replaced: the module no longer holds the old one
    assert owning_modules([old]) is None
    assert [id(m) for m in owning_modules([tied.bias])] == [id(tied)]
    assert owning_modules([nn.Parameter(torch.zeros(2))]) is None


def test_a_module_that_reads_its_childrens_parameters_waits_for_them(one_rank):
    mha = nn.MultiheadAttention(8, 2)
    opt = shardadam.DistributedFusedAdam(mha.parameters(), lr=1e-2, overlap_param_sync=True)
    x = torch.randn(5, 1, 8)
    mha(x, x, x)[0].sum().backward()
    opt.step()
    opt.waited = []
    make_current = opt._make_current
    opt._make_current = lambda params: (opt.waited.append({tuple(p.shape) for p in params}), make_current(params))
    mha(x, x, x)
    assert opt.waited[0] == {(24, 8), (24,), (8, 8), (8,)}  # its own and out_proj's, before its forward


def test_remembering_owners_leaves_parameters_swappable():
    """The registry holds the modules weakly, never the parameters:
    swap_tensors refuses a tensor that has a weak reference."""
    model = nn.Linear(4, 2)
    ids = [id(p) for p in model.parameters()]
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert [id(p) for p in model.parameters()] == ids and model.weight.dtype == torch.float64
    assert [id(m) for m in owning_modules(list(model.parameters()))] == [id(model)]
