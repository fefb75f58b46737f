"""FusedAdam(capturable=True) on CUDA: device lr/step tensors, a whole training
step captured in a CUDA graph and replayed == eager FusedAdam, LR schedulers
writing the lr tensor between replays, checkpoints."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import randn, saved_steps
from shardadam import FusedAdam
from test_fused_adam_helpers import BF16, F16, F32, close, true_state

pytestmark = pytest.mark.cuda

LR = 2.0 ** -10  # exact in float32, so the device lr equals the eager float
ULP = {F32: 2.0 ** -23, BF16: 2.0 ** -7, F16: 2.0 ** -10}

CONFIGS = {
    "fp32": (F32, {}),
    "fp32-amsgrad": (F32, dict(amsgrad=True)),
    "bf16-master-fp16-states": (BF16, dict(master_weights=True, exp_avg_dtype=F16, exp_avg_sq_dtype=F16)),
}
SCHEDULERS = {
    "no-scheduler": None,
    "steplr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "lambdalr": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** (e // 3)),
}


def _model(dtype):
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to("cuda", dtype)


def _train_step(model, opt, x, y):
    opt.zero_grad(set_to_none=False)  # gradients stay the same tensors: static for the graph
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _compare(model, opt, eager, eopt, dtype, opts):
    for i, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        if opts.get("master_weights"):
            close(opt.state[p]["master_param"], eopt.state[q]["master_param"], f"master[{i}]", atol_rel=1e-6)
            assert torch.equal(p, opt.state[p]["master_param"].to(dtype))
            close(p.float(), q.float(), f"param[{i}]", rtol=ULP[dtype], atol_rel=ULP[dtype])
        else:
            close(p, q, f"param[{i}]", atol_rel=1e-6)
        for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if opts.get("amsgrad") else ()):
            dt = opt.state[p][k].dtype
            tol = 1e-6 if dt == F32 else 2 * ULP[dt]
            close(true_state(opt, p, k), true_state(eopt, q, k), f"state[{i}]['{k}']", rtol=tol, atol_rel=tol)


def test_capturable_keeps_lr_and_step_on_the_device():
    a, b = nn.Parameter(randn(100, device="cuda")), nn.Parameter(randn(7, device="cuda"))
    opt = FusedAdam([a], lr=torch.tensor(LR, dtype=torch.float64), capturable=True, weight_decay=0.01)
    opt.add_param_group(dict(params=[b], lr=2 * LR))
    ref = [nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())]
    eopt = FusedAdam([dict(params=[ref[0]]), dict(params=[ref[1]], lr=2 * LR)], lr=LR, weight_decay=0.01)
    for g in opt.param_groups:
        for key in ("lr", "step"):
            t = g[key]
            assert isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.dtype == F32 and t.dim() == 0, key
    assert opt.param_groups[0]["lr"].item() == LR and opt.param_groups[1]["lr"].item() == 2 * LR
    for s in range(1, 6):
        for p, r in zip((a, b), ref):
            p.grad = randn(p.shape, device="cuda")
            r.grad = p.grad.clone()
        opt.step()
        eopt.step()
        assert [g["step"].item() for g in opt.param_groups] == [s, s]
    close(a, ref[0], "a", atol_rel=1e-6)
    close(b, ref[1], "b", atol_rel=1e-6)
    sd = opt.state_dict()
    assert saved_steps(sd) == [5, 5]
    assert all(not isinstance(g["lr"], torch.Tensor) for g in sd["param_groups"])


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_captured_training_step_matches_eager(config, sched):
    dtype, opts = CONFIGS[config]
    make_sched = SCHEDULERS[sched]
    model = _model(dtype)
    eager = copy.deepcopy(model)
    kw = dict(lr=LR, betas=(0.9, 0.99), weight_decay=0.01, **opts)
    opt = FusedAdam(model.parameters(), capturable=True, **kw)
    eopt = FusedAdam(eager.parameters(), **kw)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device.type == "cuda"
    scheduler = make_sched(opt) if make_sched else None
    escheduler = make_sched(eopt) if make_sched else None
    warmup, replays = 3, 8
    data = [(randn((8, 16), dtype, "cuda"), randn((8, 8), F32, "cuda")) for _ in range(warmup + replays)]
    static_x, static_y = torch.zeros_like(data[0][0]), torch.zeros_like(data[0][1])

    # Warm up on a side stream (builds the gradients, the state and the launch plan).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(warmup):
            static_x.copy_(data[k][0])
            static_y.copy_(data[k][1])
            _train_step(model, opt, static_x, static_y)
            if scheduler is not None:
                scheduler.step()
    torch.cuda.current_stream().wait_stream(side)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _train_step(model, opt, static_x, static_y)
    torch.cuda.synchronize()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert opt.param_groups[0]["step"].item() == warmup, "capture must not run the step"
    after_warmup = [p.detach().clone() for p in model.parameters()]

    for k in range(warmup, warmup + replays):
        static_x.copy_(data[k][0])
        static_y.copy_(data[k][1])
        graph.replay()
        if scheduler is not None:
            scheduler.step()  # writes the lr tensor in place: the next replay reads it
    for k in range(warmup + replays):
        _train_step(eager, eopt, *data[k])
        if escheduler is not None:
            escheduler.step()
    torch.cuda.synchronize()

    assert opt.param_groups[0]["step"].item() == warmup + replays
    assert opt.param_groups[0]["lr"] is lr, "the lr tensor was replaced: the graph would not see it"
    assert lr.item() == eopt.param_groups[0]["lr"]
    if scheduler is not None:
        assert lr.item() < LR, "the scheduler never lowered the lr"
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), after_warmup)), "replays changed nothing"
    _compare(model, opt, eager, eopt, dtype, opts)


def test_capturable_state_dict_round_trip():
    """A capturable checkpoint holds plain numbers and loads into a capturable
    optimizer (lr/step tensors filled in place) or a non-capturable one."""
    model = _model(F32)
    opt = FusedAdam(model.parameters(), lr=LR, capturable=True, weight_decay=0.01)
    data = [(randn((8, 16), device="cuda"), randn((8, 8), device="cuda")) for _ in range(8)]
    for x, y in data[:4]:
        _train_step(model, opt, x, y)
    sd = copy.deepcopy(opt.state_dict())
    model_sd = copy.deepcopy(model.state_dict())
    assert saved_steps(sd) == [4] and sd["param_groups"][0]["lr"] == LR
    for x, y in data[4:]:
        _train_step(model, opt, x, y)
    for capturable in (True, False):
        fresh = _model(F32)
        fresh.load_state_dict(model_sd)
        fopt = FusedAdam(fresh.parameters(), lr=0.5, capturable=capturable)
        lr_obj = fopt.param_groups[0]["lr"]
        fopt.load_state_dict(sd)
        if capturable:
            assert fopt.param_groups[0]["lr"] is lr_obj and fopt.param_groups[0]["lr"].item() == LR
            assert fopt.param_groups[0]["step"].item() == 4
        else:
            assert fopt.param_groups[0]["lr"] == LR and fopt.param_groups[0]["step"] == 4
        for x, y in data[4:]:
            _train_step(fresh, fopt, x, y)
        for i, (p, q) in enumerate(zip(fresh.parameters(), model.parameters())):
            close(p, q, f"capturable={capturable}: param[{i}]", atol_rel=1e-6)
