"""FusedLion and DistributedFusedLion: the second update rule on the shared
optimizers ([Note: update rules] in _rules.py), against a plain torch Lion
(torch_lion.py: lion-pytorch's update) on the same batches. The spawned
distributed runs reuse test_distributed.py's workers with optimizer="lion"."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from test_distributed import CHECKPOINT_FORMATS, STEPS, _config, _dcp_worker, _reference, _spawn, _worker
from torch_lion import TorchLion

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _model(device, dtype=F32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3))
    return model.to(device, dtype, memory_format=torch.channels_last)


def _groups(model: nn.Module) -> list[dict]:
    """Per-group hyperparameters that differ: decay on weights, another lr and
    betas on biases, an empty group."""
    weights = [p for p in model.parameters() if p.dim() >= 2]
    biases = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=weights, weight_decay=0.1), dict(params=biases, lr=2e-2, betas=(0.8, 0.95)),
            dict(params=[], lr=5e-3)]


def _batches(device, dtype, steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, 8, 3, 6, 6, generator=g).to(device, dtype)
    y = torch.randn(steps, 8, 3, generator=g).to(device, dtype)
    return x, y


def _train(model, opt, x, y, steps, scaler=None, inf_step=None) -> None:
    for s in steps:
        opt.zero_grad()
        loss = F.mse_loss(model(x[s]).float(), y[s].float())
        if s == inf_step:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _torch_run(device, steps=range(STEPS), **kw):
    """TorchLion in fp32 on the same model and batches: (params, optimizer)."""
    model = _model(device)
    opt = TorchLion(_groups(model), lr=1e-2)
    x, y = _batches(device, F32)
    _train(model, opt, x, y, steps, **kw)
    return [p.detach() for p in model.parameters()], opt


def _close(got, want, what, rtol=1e-6, atol=1e-6) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- FusedLion


def test_fused_lion_matches_torch_lion(device):
    model = _model(device)
    opt = shardadam.FusedLion(_groups(model), lr=1e-2)
    x, y = _batches(device, F32)
    _train(model, opt, x, y, range(STEPS))
    want, topt = _torch_run(device)
    for i, (p, w) in enumerate(zip(model.parameters(), want)):
        _close(p, w, f"param {i}")
    tparams = [p for g in topt.param_groups for p in g["params"]]
    fparams = [p for g in opt.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(fparams, tparams)):
        _close(opt.state[p]["exp_avg"], topt.state[q]["exp_avg"], f"exp_avg {i}")
    assert [opt.param_groups[g]["step"] for g in range(3)] == [STEPS] * 3


def test_fused_lion_maximize_is_lion_on_the_negated_loss(device):
    model, other = _model(device), _model(device)
    opt = shardadam.FusedLion(model.parameters(), lr=1e-2, weight_decay=0.1, maximize=True)
    ref = TorchLion(other.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = _batches(device, F32)
    for s in range(STEPS):
        for m, o, sign in ((model, opt, -1.0), (other, ref, 1.0)):
            o.zero_grad()
            (sign * F.mse_loss(m(x[s]), y[s])).backward()
            o.step()
    for i, (p, q) in enumerate(zip(model.parameters(), other.parameters())):
        _close(p, q, f"param {i}")


def _fp16_scaled(m: torch.Tensor) -> torch.Tensor:
    """What fp16 storage with a per-tensor power-of-two scale keeps of m:
    the scale maps the absolute maximum just under 2^15 (cpp/adam_math.h)."""
    amax = float(m.abs().max()) if m.numel() else 0.0
    if not amax > 0:
        return m.clone()
    scale = math.ldexp(1.0, max(-126, min(126, 15 - math.frexp(amax)[1])))
    return (m * scale).half().float() / scale


@pytest.mark.parametrize("kind", ["bf16-master", "bf16-remainders", "fp16-states"])
def test_fused_lion_storage_kinds(device, kind):
    """bf16 parameters with an fp32 master (or the exact master that int16
    remainders make) follow fp32 Lion on the same gradients, and the bf16
    parameter is that master rounded; fp16 exp_avg (per-tensor scales)
    follows Lion whose exp_avg is rounded the same way after every step."""
    dtype = F32 if kind == "fp16-states" else BF16
    options = {"bf16-master": dict(master_weights=True), "bf16-remainders": dict(store_param_remainders=True),
               "fp16-states": dict(exp_avg_dtype=F16)}[kind]
    model = _model(device, dtype)
    opt = shardadam.FusedLion(_groups(model), lr=1e-2, **options)
    ref_model = _model(device)
    with torch.no_grad():  # the reference starts from the same (bf16-rounded) values
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.copy_(q.float())
    ref = TorchLion(_groups(ref_model), lr=1e-2)
    x, y = _batches(device, dtype)
    for s in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x[s]).float(), y[s].float()).backward()
        opt.step()
        ref.zero_grad()
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.grad = q.grad.float()  # the same gradients: the comparison is the update, not the model
        ref.step()
        if kind == "fp16-states":
            for state in ref.state.values():
                state["exp_avg"].copy_(_fp16_scaled(state["exp_avg"]))
    saved = opt.state_dict()["state"]  # keyed by position in param_groups order
    fparams = [p for g in opt.param_groups for p in g["params"]]
    rparams = [p for g in ref.param_groups for p in g["params"]]
    for i, (p, q) in enumerate(zip(fparams, rparams)):
        master = saved[i]["master_param"] if dtype == BF16 else p
        _close(master, q, f"master {i}")
        if kind == "bf16-master":
            assert torch.equal(p, master.to(BF16)), f"param {i} is not its master rounded to nearest"
        elif kind == "bf16-remainders":  # the high half: rounded to nearest, ties away from zero
            _close(p, master, f"param {i}", rtol=2.0 ** -8, atol=0)
        _close(saved[i]["exp_avg"], ref.state[q]["exp_avg"], f"exp_avg {i}")


def test_fused_lion_skips_nonfinite_gradients_bit_for_bit(device):
    model = _model(device)
    opt = shardadam.FusedLion(model.parameters(), lr=1e-2, weight_decay=0.1, skip_nonfinite_grads=True)
    x, y = _batches(device, F32)
    _train(model, opt, x, y, range(2))
    before = [p.detach().clone() for p in model.parameters()]
    states = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    _train(model, opt, x, y, [2], inf_step=2)
    for i, (p, b, s) in enumerate(zip(model.parameters(), before, states)):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg"], s), f"param {i} changed"
    assert int(opt.skipped_steps) == 1 and opt.param_groups[0]["step"] == 2


def test_fused_lion_grad_scaler_skips_like_torch(device):
    """GradScaler: the step with an inf loss is skipped and the scale backs
    off, as for a plain torch Lion; capturable on CUDA (the scaler hands its
    scale and found-inf to the step)."""
    capturable = device == "cuda"
    model = _model(device)
    opt = shardadam.FusedLion(_groups(model), lr=1e-2, capturable=capturable)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    x, y = _batches(device, F32)
    _train(model, opt, x, y, range(STEPS), scaler=scaler, inf_step=2)
    ref_scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    want, _ = _torch_run(device, scaler=ref_scaler, inf_step=2)
    assert scaler.get_scale() == ref_scaler.get_scale()
    for i, (p, w) in enumerate(zip(model.parameters(), want)):
        _close(p, w, f"param {i}")
    assert int(opt.param_groups[0]["step"]) == STEPS - 1


@pytest.mark.cuda
def test_fused_lion_captured_step_equals_eager():
    """A step captured in a CUDA graph and replayed equals eager steps."""
    x, y = _batches("cuda", F32)
    eager = _model("cuda")
    eopt = shardadam.FusedLion(_groups(eager), lr=1e-2)
    _train(eager, eopt, x, y, range(STEPS))
    model = _model("cuda")
    opt = shardadam.FusedLion(_groups(model), lr=1e-2, capturable=True)
    static_x, static_y = x[0].clone(), y[0].clone()

    def step():
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(static_x), static_y).backward()
        opt.step()

    step()  # the first step builds the buckets and plans, outside the graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.current_stream().wait_stream(side)
    # Capture ran nothing: undo nothing. Replay steps 1..STEPS-1 on their batches.
    for s in range(1, STEPS):
        static_x.copy_(x[s])
        static_y.copy_(y[s])
        graph.replay()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        _close(p, q, f"param {i}", rtol=0, atol=0)


def test_fused_lion_state_dict_round_trips_and_loads_torch_lion(device):
    x, y = _batches(device, F32)
    whole = _model(device)
    wopt = shardadam.FusedLion(_groups(whole), lr=1e-2)
    _train(whole, wopt, x, y, range(STEPS))
    # FusedLion -> FusedLion (fp16 exp_avg storage on the way in) -> same run
    first = _model(device)
    fopt = shardadam.FusedLion(_groups(first), lr=1e-2)
    _train(first, fopt, x, y, range(3))
    saved = fopt.state_dict()
    assert set(saved["state"][0]) == {"exp_avg"}
    second = _model(device)
    second.load_state_dict(first.state_dict())
    sopt = shardadam.FusedLion(_groups(second), lr=1e-2)
    sopt.load_state_dict(saved)
    _train(second, sopt, x, y, range(3, STEPS))
    for i, (p, q) in enumerate(zip(second.parameters(), whole.parameters())):
        assert torch.equal(p, q), f"param {i}: the continued run left the uninterrupted one"
    # lion-pytorch's state dict (exp_avg per parameter, no step) loads too
    tmodel = _model(device)
    topt = TorchLion(_groups(tmodel), lr=1e-2)
    _train(tmodel, topt, x, y, range(3))
    third = _model(device)
    third.load_state_dict(tmodel.state_dict())
    lopt = shardadam.FusedLion(_groups(third), lr=1e-2)
    lopt.load_state_dict(topt.state_dict())
    _train(third, lopt, x, y, range(3, STEPS))
    _train(tmodel, topt, x, y, range(3, STEPS))
    for i, (p, q) in enumerate(zip(third.parameters(), tmodel.parameters())):
        _close(p, q, f"param {i}")


def test_fused_lion_refuses_adam_state_and_bad_hyperparameters():
    model = _model("cpu")
    adam = torch.optim.AdamW(model.parameters())
    F.mse_loss(model(torch.randn(2, 3, 6, 6)), torch.zeros(2, 3)).backward()
    adam.step()
    opt = shardadam.FusedLion(model.parameters(), lr=1e-2)
    opt.step()
    before = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="unknown state 'exp_avg_sq'.*Lion"):
        opt.load_state_dict(adam.state_dict())
    assert all(torch.equal(opt.state[p]["exp_avg"], b) for p, b in zip(model.parameters(), before))
    for kw, word in ((dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.99)), "betas"),
                     (dict(weight_decay=float("nan")), "weight_decay")):
        with pytest.raises(ValueError, match=word):
            shardadam.FusedLion(model.parameters(), **kw)
    opt.param_groups[0]["lr"] = float("inf")
    with pytest.raises(ValueError, match="lr"):
        opt.step()


# ---------------------------------------------------------------- DistributedFusedLion


@pytest.mark.parametrize("world,kw", [
    (2, {}),
    (3, dict(bucket_cap_mb=100.0)),
    (2, dict(overlap_param_sync=True, contiguous_param_buffer=True, model="reordered")),
    (3, dict(contiguous_grad_buffer=True, micro=2)),
    (2, dict(micro=3, accumulate="every")),
    (4, dict(redundant=True)),
    (2, dict(model="branch")),
    (3, dict(scaler=True, inf_step=2)),
    (2, dict(scaler=True, clip=0.02, overlap_param_sync=True)),
    (2, dict(store_params=False)),
    pytest.param(2, dict(device="cuda", overlap_param_sync=True, contiguous_param_buffer=True, model="reordered"),
                 marks=pytest.mark.multigpu),
    pytest.param(2, dict(device="cuda", capture=True, scaler=True, clip=0.02), marks=pytest.mark.multigpu),
], ids=["world-2", "one-bucket-3", "overlap-contiguous-params", "contiguous-grads-no_sync", "sync-every",
        "redundant-2x2", "gradients-absent-on-rank-1", "grad-scaler-inf-skips", "grad-scaler-clip",
        "store-params-false", "nccl-2-copy-engines", "nccl-2-captured"])
def test_distributed_lion_matches_torch_lion_on_the_global_batch(world, kw):
    cfg = _config(optimizer="lion", **kw)
    result = _spawn(_worker, world, cfg)
    assert result["same_on_all_ranks"], "ranks disagree on the parameters"
    assert result["frozen_unchanged"], "a frozen parameter was modified"
    want, norms, scale = _reference(world, model_kind=cfg["model"], scaler=cfg["scaler"], inf_step=cfg["inf_step"],
                                    clip=cfg["clip"], optimizer="lion")
    assert result["scale"] == scale, "the loss scale must back off exactly as torch's"
    if cfg["clip"] is not None:
        np.testing.assert_allclose(result["norms"], norms, rtol=1e-5)
    assert result["steps"] == [STEPS - (cfg["inf_step"] is not None)] * 4
    for i, (got, w) in enumerate(zip(result["params"], want)):
        torch.testing.assert_close(torch.from_numpy(got), w.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


def test_distributed_lion_remainders_follow_fp32_masters():
    """bf16 parameters with remainders stay within a bf16 rounding of the
    run with fp32 masters."""
    kw = dict(dtype=torch.bfloat16, overlap_param_sync=True)
    base = _spawn(_worker, 3, _config(optimizer="lion", **kw))
    compact = _spawn(_worker, 3, _config(optimizer="lion", remainders=True, **kw))
    assert compact["same_on_all_ranks"]
    for i, (a, b) in enumerate(zip(compact["params"], base["params"])):
        np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=0, err_msg=f"param {i}")


def test_distributed_lion_scaled_states_follow_fp32_but_for_a_few_signs():
    """fp16 master and exp_avg (per-fragment scales): each stored value is
    within 2^-11 of fp32 state, so parameters stay within 2e-3 of the fp32
    run, except where beta1 * exp_avg + (1 - beta1) * grad is so near 0 that
    the rounding flips its sign: that element then moves by 2 * lr against
    the fp32 run. Such flips are rare (at most 1% of elements here), and no
    element is further off than one flip per step."""
    base = _spawn(_worker, 2, _config(optimizer="lion"))
    compact = _spawn(_worker, 2, _config(optimizer="lion", scaled_states=True))
    assert compact["same_on_all_ranks"]
    diffs = np.concatenate([np.abs(a - b).reshape(-1) for a, b in zip(compact["params"], base["params"])])
    assert diffs.max() > 0, "fp16 states must differ from fp32 somewhere"
    assert np.mean(diffs > 2e-3) <= 0.01, f"{np.sum(diffs > 2e-3)} of {diffs.size} elements off by > 2e-3"
    assert diffs.max() <= 2 * 2e-2 * STEPS + 2e-3, "more than one sign flip per step"


def test_distributed_lion_checkpoints_reshard(tmp_path):
    """Saved on 2 ranks in both formats (DCP and portable), each loaded on 3
    with other buckets: the continued run ends where the uninterrupted one
    (and torch's Lion) ends."""
    cfg = dict(dtype=torch.float32, remainders=False, scaled_states=False, bucket_cap_mb=1e-4,
               optimizer="lion", device="cpu", capturable=False)
    path = str(tmp_path / "ckpt")
    assert _spawn(_dcp_worker, 2, path, cfg)["saved"]
    result = _spawn(_dcp_worker, 3, path, dict(cfg, bucket_cap_mb=100.0))
    for fmt in CHECKPOINT_FORMATS:
        assert result["steps"][fmt] == [STEPS] * 4
        for i, (got, w) in enumerate(zip(result["params"][fmt], _reference(2, optimizer="lion")[0])):
            torch.testing.assert_close(torch.from_numpy(got), w.contiguous(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{fmt}, param {i}: {m}")
