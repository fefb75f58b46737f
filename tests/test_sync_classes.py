"""DistributedFusedAdam with parameters that travel in different dtypes
([Note: sync classes] in distributed/_rows.py): apex's per-call
init_params(..., grad_sync_dtype=, param_sync_dtype=), models mixing fp32 and
bf16 parameters, and float64 parameters (carried in float32, as apex does).

The reference is independent of shardadam: torch's AdamW on fp32 masters,
each rank's gradient rounded to its parameter's grad_sync_dtype and summed in
that dtype (what a 2-rank reduction in it computes), and the model's
parameters set to the masters rounded to their param_sync_dtype after each
step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from test_distributed import _exit, _rank_group, _spawn, _spawn_all

STEPS, GLOBAL_BATCH = 5, 24
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (device, ranks): gloo on the CPU; NCCL with one rank per GPU.
PLACES = [("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.cuda, id="cuda-1"),
          pytest.param("cuda", 2, marks=[pytest.mark.cuda, pytest.mark.multigpu], id="cuda-2")]


class _Net(nn.Module):
    """Three linear layers, each in its own dtype, each casting its input to it."""

    def __init__(self, dtypes=(F32, F32, F32)):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)])
        for layer, dtype in zip(self.layers, dtypes):
            layer.to(dtype)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.dtype))
            x = torch.tanh(x) if i < 2 else x
        return x.float()


def _groups(params: list) -> list[dict]:
    """Weights with decay, biases at another lr, an empty group, the last bias frozen."""
    frozen = params[-1]
    return [dict(params=[p for p in params if p.dim() == 2], weight_decay=0.1),
            dict(params=[p for p in params[:-1] if p.dim() == 1], weight_decay=0.0, lr=2e-2),
            dict(params=[], lr=5e-3), dict(params=[frozen])]


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 6, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 3, generator=g)


def _classes(dtypes, init_params: list, grad_sync_dtype=None, param_sync_dtype=None) -> list[tuple]:
    """Each parameter's (grad, param) sync dtypes as the docs define them: the
    constructor's, else its own dtype (float32 for float64), changed by each
    init_params(indices, grad_sync_dtype=, param_sync_dtype=) call in order."""
    params = list(_Net(dtypes).parameters())
    classes = []
    for p in params:
        param = param_sync_dtype or (p.dtype if p.dtype in KERNEL_DTYPES else F32)
        classes.append((grad_sync_dtype or param, param))
    for indices, kw in init_params:
        for i in indices:
            grad, param = classes[i]
            classes[i] = (kw.get("grad_sync_dtype") or grad, kw.get("param_sync_dtype") or param)
    return classes


def _reference(dtypes, classes: list[tuple], device: str, world: int) -> tuple[list, dict]:
    """(the model's parameters, the fp32 masters by parameter) after STEPS
    steps on `world` ranks' batches, computed on `device` (the kernels of
    forward and backward the ranks run)."""
    model = _Net(dtypes).to(device)
    params = list(model.parameters())
    params[-1].requires_grad_(False)
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(_groups(masters), lr=1e-2, foreach=False)
    x, y = (t.to(device) for t in _data())
    local = GLOBAL_BATCH // world
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    for s in range(STEPS):
        per_rank = [torch.autograd.grad(F.mse_loss(model(x[s, r * local:(r + 1) * local]),
                                                   y[s, r * local:(r + 1) * local]), [params[i] for i in trainable])
                    for r in range(world)]
        for i, grads in zip(trainable, zip(*per_rank)):
            dtype = classes[i][0]
            total = grads[0].to(dtype)
            for g in grads[1:]:  # summed in the sync dtype, as the reduction does
                total = total + g.to(dtype)
            masters[i].grad = total.float() / world
        opt.step()
        with torch.no_grad():
            for i in trainable:
                params[i].copy_(masters[i].to(classes[i][1]))
    return [p.detach() for p in params], {i: masters[i] for i in trainable}


def _worker(rank: int, world: int, port: int, cfg: dict, out) -> None:
    device = cfg["device"] if cfg["device"] == "cpu" else f"cuda:{rank}"
    if device != "cpu":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "gloo" if device == "cpu" else "nccl"):
        model = _Net(cfg["dtypes"]).to(device)
        params = list(model.parameters())
        params[-1].requires_grad_(False)
        opt = shardadam.DistributedFusedAdam(_groups(params), lr=1e-2, bucket_cap_mb=1e-4, **cfg["options"])
        for indices, kw in cfg["init_params"]:
            opt.init_params([params[i] for i in indices], **kw)
        x, y = (t.to(device) for t in _data())
        local = GLOBAL_BATCH // world
        for s in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[s, rank * local:(rank + 1) * local]), y[s, rank * local:(rank + 1) * local]).backward()
            opt.step()
        opt.param_sync()
        order = [next(i for i, q in enumerate(params) if q is p) for g in opt.param_groups for p in g["params"]]
        masters = {order[k]: v["param"].double().cpu().numpy().copy()
                   for k, v in opt.state_dict()["state"].items()}
        if rank == 0:
            out.put(dict(params=[p.detach().double().cpu().numpy().copy() for p in params], masters=masters,
                         keys=len({b.key for b in opt.layout.buckets}),
                         grad_dtypes=sorted({str(row.dtype) for row in opt.grad_shards.rows}),
                         param_dtypes=sorted({str(row.dtype) for row in opt.param_shards.rows}),
                         transports=opt.transports))
    _exit()


def _check(result: dict, dtypes, classes, device: str, world: int) -> None:
    """Within fp32 rounding of the reference (measured: 9e-8 at most). Where
    parameters travel in bf16, a master a hair apart may round the other
    way: that parameter then differs by one bf16 step, and the masters by
    what the changed gradients move them (well under 1e-5 at lr 1e-2)."""
    want_params, want_masters = _reference(dtypes, classes, device, world)
    for i, (got, want) in enumerate(zip(result["params"], want_params)):
        rtol = 2.0 ** -8 if classes[i][1] == BF16 else 1e-5
        np.testing.assert_allclose(got, want.double().cpu().numpy(), rtol=rtol, atol=1e-7, err_msg=f"param {i}")
        exact = torch.from_numpy(got).to(classes[i][1]).double().numpy()
        np.testing.assert_array_equal(got, exact, err_msg=f"param {i} is not a {classes[i][1]} value")
    atol = 1e-5 if any(param == BF16 for _, param in classes) else 1e-7
    assert sorted(result["masters"]) == sorted(want_masters)
    for i, want in want_masters.items():
        np.testing.assert_allclose(result["masters"][i], want.double().cpu().numpy(), rtol=1e-5, atol=atol,
                                   err_msg=f"master {i}")


# apex's test_matches_pytorch_multi_dtypes: every third parameter's gradients
# in bf16, the next one's parameters all-gathered in bf16.
APEX_MULTI_DTYPES = [([0, 3], dict(grad_sync_dtype=BF16)), ([1, 4], dict(param_sync_dtype=BF16))]


@pytest.mark.parametrize("device, world", PLACES)
@pytest.mark.parametrize("options", [dict(), dict(overlap_param_sync=True, overlap_grad_sync=False)],
                         ids=["overlap-grads", "overlap-params"])
def test_per_call_sync_dtypes_match_adamw_with_those_roundings(device, world, options):
    """Three sync classes in one optimizer (fp32, bf16 gradients, bf16
    parameters) equal AdamW with each class's rounding."""
    cfg = dict(device=device, dtypes=(F32,) * 3, options=options, init_params=APEX_MULTI_DTYPES)
    result = _spawn(_worker, world, cfg)
    assert result["keys"] == 3
    assert result["grad_dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert result["param_dtypes"] == ["torch.bfloat16", "torch.float32"]
    _check(result, (F32,) * 3, _classes((F32,) * 3, APEX_MULTI_DTYPES), device, world)


@pytest.mark.parametrize("device, world", PLACES)
def test_mixed_dtype_model_with_contiguous_buffers(device, world):
    """fp32 and bf16 layers: each parameter syncs in its own dtype by
    default, and the contiguous buffers hold each class in its own dtype
    (the parameters and gradients are views of them)."""
    dtypes = (F32, BF16, F32)
    result = _spawn(_worker, world, dict(device=device, dtypes=dtypes, init_params=[],
                                         options=dict(contiguous_param_buffer=True, contiguous_grad_buffer=True)))
    assert result["keys"] == 2
    _check(result, dtypes, _classes(dtypes, []), device, world)


@pytest.mark.parametrize("device, world", PLACES)
def test_float64_parameters_travel_in_float32(device, world):
    """float64 parameters (apex's test_matches_pytorch_fp64): gradients and
    parameters synchronised in fp32, masters in fp32, so the model holds fp32
    values."""
    dtypes = (F64,) * 3
    result = _spawn(_worker, world, dict(device=device, dtypes=dtypes, init_params=[], options={}))
    assert result["grad_dtypes"] == result["param_dtypes"] == ["torch.float32"]
    _check(result, dtypes, _classes(dtypes, []), device, world)


def _disagreeing_worker(rank: int, world: int, port: int, out) -> None:
    with _rank_group(rank, world, port, out):
        model = _Net()
        params = list(model.parameters())
        opt = shardadam.DistributedFusedAdam(params, lr=1e-2, bucket_cap_mb=1e-4)
        layout = opt.layout
        try:
            opt.init_params([params[rank]], grad_sync_dtype=BF16)
            error = None
        except ValueError as e:
            error = str(e)
        unchanged = opt.layout is layout and len({b.key for b in opt.layout.buckets}) == 1
        model(torch.randn(4, 6)).sum().backward()
        opt.step()  # no rank is left waiting in a collective
        out.put((rank, dict(error=error, unchanged=unchanged)))
    _exit()


def test_ranks_asking_for_different_sync_dtypes_all_refuse():
    results = _spawn_all(_disagreeing_worker, 2)
    for rank, r in enumerate(results):
        assert r["unchanged"], rank
        assert r["error"] is not None and "asked for different sync dtypes" in r["error"], (rank, r["error"])
        assert "rank 0" in r["error"] and "rank 1" in r["error"], r["error"]


# ------------------------------------------------------------ one rank, in process

def _dfa(model, **kw):
    return shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4, **kw)


@pytest.mark.parametrize("dtypes, kw, call, match", [
    ((F32,) * 3, dict(contiguous_param_buffer=True), dict(param_sync_dtype=BF16),
     r"contiguous_param_buffer=True needs every trainable parameter in its param_sync_dtype.*torch.float32 with "
     r"param_sync_dtype=torch.bfloat16"),
    ((F32,) * 3, dict(contiguous_grad_buffer=True), dict(grad_sync_dtype=BF16),
     r"contiguous_grad_buffer=True needs every trainable parameter in its grad_sync_dtype"),
    ((BF16,) * 3, dict(store_params=False, store_param_remainders=True), dict(param_sync_dtype=F32),
     r"store_param_remainders=True needs bf16 parameters synchronised in bf16 .*torch.bfloat16 parameters "
     r"synchronised in torch.float32"),
    ((F32,) * 3, {}, dict(grad_sync_dtype=torch.int32), r"grad_sync_dtype=torch.int32: the sync dtypes must be"),
    ((F32,) * 3, {}, dict(param_sync_dtype=F64), r"param_sync_dtype=torch.float64: the sync dtypes must be"),
], ids=["param-buffer", "grad-buffer", "remainders", "integer", "float64"])
def test_per_call_sync_dtypes_are_refused_before_anything_changes(one_rank, dtypes, kw, call, match):
    model = _Net(dtypes)
    opt = _dfa(model, **kw)
    layout, classes = opt.layout, dict(opt._sync_class)
    with pytest.raises(ValueError, match=match):
        opt.init_params([next(model.parameters())], **call)
    assert opt.layout is layout and opt._sync_class == classes


@pytest.mark.parametrize("kw, match", [
    (dict(contiguous_param_buffer=True), r"contiguous_param_buffer=True needs every trainable parameter in its "
                                         r"param_sync_dtype.*torch.float64 with param_sync_dtype=torch.float32"),
    (dict(param_sync_dtype=F64), r"param_sync_dtype=torch.float64: the sync dtypes must be"),
], ids=["buffer", "sync-float64"])
def test_float64_refusals(one_rank, kw, match):
    with pytest.raises(ValueError, match=match):
        _dfa(_Net((F64,) * 3), **kw)


def test_copy_engines_name_the_sync_classes(one_rank):
    """The copy engines move one tensor per direction: mixed sync classes are
    named among what grad_sync_copy_engine=True lacks."""
    with pytest.raises(ValueError, match=r"grad_sync_copy_engine=True needs one grad_sync_dtype and one "
                                         r"param_sync_dtype for every parameter"):
        _dfa(_Net((F32, BF16, F32)), grad_sync_copy_engine=True)


def test_state_survives_a_change_of_sync_classes(one_rank):
    """init_params with sync dtypes after some parameters started rebuilds
    the layout: the started parameters keep their state, and the others
    start from their values at their first step (weights loaded after the
    call are the ones trained)."""
    model = _Net()
    params = list(model.parameters())
    opt = _dfa(model, overlap_grad_sync=False)
    opt.init_params(params[:2])
    started = [p.detach().clone() for p in params[:2]]
    with torch.no_grad():
        params[0].add_(1.0)  # after it started: its master keeps the old value
    opt.init_params(params[2:4], grad_sync_dtype=BF16)
    assert len({b.key for b in opt.layout.buckets}) == 2
    done = {id(p): d for p, d in zip(opt.params, opt._initialized)}
    assert [done[id(p)] for p in params] == [True, True, True, True, False, False]
    with torch.no_grad():
        params[4].fill_(0.5)  # loaded after the call: the value its master starts from
    state = opt.state_dict()["state"]
    for k, value in enumerate(started):
        assert torch.equal(state[k]["param"], value), k
        assert not state[k]["exp_avg"].any()
    assert torch.equal(state[4]["param"], torch.full_like(params[4], 0.5))


def test_classes_without_elements_have_empty_rows(one_rank):
    """A sync class whose parameters hold no elements has no buckets (empty
    rows); a model of such parameters alone steps too."""
    empty, lone, weight = nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0, dtype=BF16)), nn.Parameter(
        torch.ones(4))
    opt = shardadam.DistributedFusedAdam([empty, lone, weight], lr=0.1, bucket_cap_mb=1e-4)
    for p in (empty, lone, weight):
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.allclose(weight.detach(), torch.full((4,), 0.9)) and empty.numel() == lone.numel() == 0
    alone = nn.Parameter(torch.zeros(0))
    opt = shardadam.DistributedFusedAdam([alone], lr=0.1)
    alone.grad = torch.zeros(0)
    opt.step()
    assert opt.state_dict()["state"][0]["param"].numel() == 0
