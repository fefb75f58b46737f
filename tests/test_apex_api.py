"""DistributedFusedAdam's apex surface, against apex's documented meaning:
the storage options (dtype, store_params / store_param_remainders,
with_scaled_states, nccl_ub), the methods (parameters, parameter,
init_params, init_param_buffer, state_dict formats) and both GradScaler
flows (no FutureWarning). One gloo rank in-process; references are torch's
AdamW and GradScaler."""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam

HYPER = dict(lr=1e-2, weight_decay=0.1)


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(s: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(s)
    return torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def _dfa(model, **kw):
    return shardadam.DistributedFusedAdam(model.parameters(), bucket_cap_mb=1e-4, **dict(HYPER, **kw))


def _train(model, opt, steps, start: int = 0) -> None:
    for s in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(s, next(model.parameters()).dtype)
        F.mse_loss(model(x), y).backward()
        opt.step()
    if hasattr(opt, "param_sync"):
        opt.param_sync()


def _close(model, want, rtol=1e-5, atol=1e-6):
    for i, (p, w) in enumerate(zip(model.parameters(), want.parameters())):
        torch.testing.assert_close(p.detach(), w.detach(), rtol=rtol, atol=atol, msg=lambda m: f"param {i}: {m}")


# ------------------------------------------------------------ constructor

@pytest.mark.parametrize("kw, match", [
    (dict(store_param_remainders=True, store_params=True),
     r"store_param_remainders=True needs store_params=False.*used to ask"),
    (dict(store_param_remainders=True, store_params=False, dtype=torch.float16), r"needs dtype=torch.float32"),
    (dict(with_scaled_states=True), r"with_scaled_states=True stores .* in `dtype`.*float16"),
    (dict(with_scaled_states=True, store_params=False, dtype=torch.float16), r"needs store_params=True"),
    (dict(dtype=torch.float64), r"dtype \(the optimizer state's dtype\) must be"),
    (dict(nccl_ub=True), r"nccl_ub=True needs contiguous_grad_buffer=True"),
    (dict(nccl_ub=True, contiguous_grad_buffer=True), r"nccl_ub=True .* needs CUDA parameters, an NCCL"),
    (dict(param_sync_dtype=torch.int32), r"param_sync_dtype=torch.int32: the sync dtypes must be .*integer"),
], ids=["remainders-with-store_params", "remainders-fp16", "scaled-fp32", "scaled-no-store", "fp64-state",
        "nccl_ub-no-grad-buffer", "nccl_ub-on-gloo", "integer-param-sync"])
def test_apex_option_rules_refuse_before_anything_changes(one_rank, kw, match):
    model = _model(torch.bfloat16 if "store_param_remainders" in kw else torch.float32)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        _dfa(model, **kw)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("dtype, kw, stored, scaled", [
    (torch.float16, {}, dict(master=torch.float16, exp_avg=torch.float16), set()),
    (torch.bfloat16, dict(store_params=False), dict(master=None, exp_avg=torch.bfloat16), set()),
    (torch.float16, dict(with_scaled_states=True), dict(master=torch.float16, exp_avg=torch.float16),
     {"master", "exp_avg", "exp_avg_sq"}),
    (torch.bfloat16, dict(with_scaled_states=True), dict(master=torch.bfloat16, exp_avg=torch.bfloat16), set()),
], ids=["fp16", "bf16-no-master", "fp16-scaled", "bf16-scaled"])
def test_dtype_is_the_state_dtype(one_rank, dtype, kw, stored, scaled):
    """dtype stores the master (when stored) and the moments, plain as apex
    stores them; fp16 carries scales only with with_scaled_states."""
    opt = _dfa(_model(), dtype=dtype, **kw)
    assert (opt.master.dtype if opt.master is not None else None) == stored["master"]
    assert opt.states["exp_avg"].dtype == opt.states["exp_avg_sq"].dtype == stored["exp_avg"]
    assert set(opt.state_scales) == scaled
    assert f"dtype={str(dtype).replace('torch.', '')}" in repr(opt)


def test_fp16_state_trains_as_torch_adamw_on_fp16(one_rank):
    """apex's test_matches_pytorch_fp16: fp16 model and state against
    torch.optim.AdamW on fp16 parameters (whose states are fp16), at apex's
    tolerance; and not equal to the fp32-state run (fp16 storage is used).
    apex's eps (0.25): 1e-8 is 0 in fp16, where torch's denominator then
    underflows to 0."""
    model, want, fp32 = _model(torch.float16), _model(torch.float16), _model(torch.float16)
    _train(model, _dfa(model, dtype=torch.float16, store_params=False, eps=0.25), 3)
    _train(want, torch.optim.AdamW(want.parameters(), foreach=False, eps=0.25, **HYPER), 3)
    _train(fp32, _dfa(fp32, eps=0.25), 3)
    _close(model, want, rtol=5e-3, atol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), fp32.parameters()))


# ------------------------------------------------------------ methods

def test_parameters_and_parameter_lookup(one_rank):
    model = _model()
    groups = [dict(params=[model[0].weight, model[2].weight]), dict(params=[model[0].bias, model[2].bias], lr=0.5)]
    opt = shardadam.DistributedFusedAdam(groups, lr=1e-2)
    assert [id(p) for p in opt.parameters()] == [id(p) for g in groups for p in g["params"]]
    assert opt.parameter(1, 0) is model[0].bias
    assert opt.parameter(types.SimpleNamespace(param_group_id=0, param_id=1)) is model[2].weight
    f = opt.layout.fragments[0]
    assert opt.parameter(f) is opt.params[f.param]
    with pytest.raises(TypeError, match=r"\(group_id, param_id\) or one fragment"):
        opt.parameter(0, 1, 2)


def test_init_params_starts_only_parameters_not_started(one_rank):
    """apex: init_params leaves started parameters as they are, their sync
    dtypes included; a per-call state dtype other than the optimizer's is
    refused before anything changes."""
    model = _model()
    opt = _dfa(model, overlap_grad_sync=False)
    _train(model, opt, 2)
    before = opt.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.init_params()
    opt.init_params([model[0].weight], dtype=torch.float32, grad_sync_dtype=torch.float32)
    after = opt.state_dict()
    for k, entry in before["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][k][name], value), (k, name)
    layout = opt.layout
    opt.init_params([model[0].weight], grad_sync_dtype=torch.bfloat16)
    assert opt.layout is layout and {row.dtype for row in opt.grad_shards.rows} == {torch.float32}
    with pytest.raises(NotImplementedError, match=r"init_params\(dtype=torch.float16\): the optimizer state has one"):
        opt.init_params([model[0].weight], dtype=torch.float16, grad_sync_dtype=torch.bfloat16)
    assert torch.equal(opt.state_dict()["state"][0]["param"], after["state"][0]["param"])


def test_init_param_buffer_makes_parameters_views_and_keeps_training(one_rank):
    """After two steps, init_param_buffer() moves the parameters into one
    buffer (the all-gather lands in place) and the state along: the run
    still equals torch's AdamW."""
    model, want = _model(), _model()
    opt = _dfa(model, overlap_grad_sync=False)
    reference = torch.optim.AdamW(want.parameters(), foreach=False, **HYPER)
    _train(model, opt, 2)
    _train(want, reference, 2)
    opt.init_param_buffer()
    buffer = opt.param_buffer.single
    assert opt.contiguous_param_buffer and buffer is not None
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    _close(model, want)
    _train(model, opt, 2, start=2)
    _train(want, reference, 2, start=2)
    _close(model, want)


def _apex_v2(portable: dict) -> dict:
    """apex's format 2 as its documentation describes it (not by pickling
    apex): the step in state["step"], none in the groups, a "format" key."""
    groups = [{k: v for k, v in g.items() if k != "step"} for g in portable["param_groups"]]
    state = {"step": portable["param_groups"][0]["step"]}
    state.update({k: {name: t.clone() for name, t in e.items()} for k, e in portable["state"].items()})
    return {"state": state, "param_groups": groups, "format": 2}


def test_state_dict_formats(one_rank):
    """state_dict_format=2 is apex's format 2 (format key, state["step"]);
    apex's format 2 built by hand, and shardadam's, load into an optimizer
    that then trains as the saver does; the caller's dict is not modified;
    format 1 is refused both ways."""
    model, saver_model = _model(), _model()
    saver = _dfa(saver_model, overlap_grad_sync=False)
    _train(saver_model, saver, 2)
    portable = saver.state_dict()
    apex = saver.state_dict(state_dict_format=2)
    assert apex["format"] == 2 and apex["state"]["step"] == 2 and "format" not in portable
    assert set(apex["state"]) == {"step", *portable["state"]}
    handmade = _apex_v2(portable)
    kept = copy.deepcopy(handmade)
    for source in (handmade, apex):
        model.load_state_dict(saver_model.state_dict())
        opt = _dfa(model, overlap_grad_sync=False, lr=1234.0)
        opt.load_state_dict(source)
        assert opt.param_groups[0]["lr"] == HYPER["lr"] and opt.param_groups[0]["step"] == 2
        got = opt.state_dict()
        for k, entry in portable["state"].items():
            for name, value in entry.items():
                assert torch.equal(got["state"][k][name], value), (k, name)
    assert handmade.keys() == kept.keys() and handmade["state"].keys() == kept["state"].keys()
    assert all("step" not in g for g in handmade["param_groups"]), "the caller's dict was modified"
    _train(model, opt, 2, start=2)
    _train(saver_model, saver, 2, start=2)
    _close(model, saver_model, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"state_dict\['format'\] is 1"):
        opt.load_state_dict(dict(handmade, format=1))
    with pytest.raises(ValueError, match=r"state_dict_format must be None .* or 2"):
        opt.state_dict(state_dict_format=1)


# ------------------------------------------------------------ GradScaler

INF_STEP = 2


def _amp_run(model, opt, flow: str, steps: int = 4) -> float:
    """Train under a GradScaler; step INF_STEP's loss is inf. flow: how the
    optimizer meets the scaler. Returns the final scale."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    for s in range(steps):
        opt.zero_grad()
        x, y = _batch(s)
        loss = F.mse_loss(model(x), y) * (float("inf") if s == INF_STEP else 1.0)
        scaler.scale(loss).backward()
        if flow == "clip" and isinstance(opt, torch.optim.AdamW):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif flow == "clip":  # apex's order
            opt.unscale_grads(grad_scaler=scaler)
            opt.clip_grad_norm(0.05)
        if flow == "apex-step" and not isinstance(opt, torch.optim.AdamW):
            opt.step(grad_scaler=scaler)
        else:
            scaler.step(opt)
        scaler.update()
    if hasattr(opt, "param_sync"):
        opt.param_sync()
    return scaler.get_scale()


@pytest.mark.parametrize("flow", ["plain", "clip", "apex-step"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_grad_scaler_flows_match_torch_without_future_warning(one_rank, flow, overlap):
    """scaler.step(opt) (torch's newer protocol), apex's clipping order
    (unscale_grads, clip_grad_norm, scaler.step) and apex's
    opt.step(grad_scaler=scaler): the scale backs off at the inf step
    exactly as torch's, the parameters equal torch AdamW's, and GradScaler
    never warns that it passes itself to step()."""
    model, want = _model(), _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scale = _amp_run(model, _dfa(model, overlap_grad_sync=overlap, overlap_param_sync=overlap), flow)
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, [str(w.message) for w in future]
    want_scale = _amp_run(want, torch.optim.AdamW(want.parameters(), foreach=False, **HYPER), flow)
    assert scale == want_scale
    _close(model, want)


def test_unscale_grads_contract(one_rank):
    """apex's unscale_grads: inv_scale by keyword or position, exactly one of
    inv_scale / grad_scaler, returns {device: found_inf}, once per iteration."""
    model = _model()
    opt = _dfa(model)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="exactly one of inv_scale or grad_scaler"):
        opt.unscale_grads()
    found = opt.unscale_grads(0.5)
    assert list(found) == [torch.device("cpu")] and float(found[torch.device("cpu")]) == 0.0
    with pytest.raises(RuntimeError, match="already called in this iteration"):
        opt.unscale_grads(inv_scale=0.5)


# ------------------------------------------------------------ nccl_ub (2 GPUs)

def _nccl_ub_worker(rank: int, world: int, port: int, out) -> None:
    """nccl_ub=True on NCCL: the gradient buffer and the reduced shards lie in
    the NCCL-registered pool, and training equals single-process AdamW."""
    from test_distributed import STEPS, _exit, _frozen, _groups, _model as _net, _rank_group, _train as _run
    torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl"):
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        model = _net().to(f"cuda:{rank}")
        frozen = _frozen(model)
        frozen.requires_grad_(False)
        opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                             contiguous_grad_buffer=True, nccl_ub=True)
        segments = [(s["address"], s["address"] + s["total_size"]) for s in opt._nccl_pool.pool.snapshot()]
        held = (opt.grad_buffer.single, opt.grad_shards.single)
        inside = [any(a <= t.data_ptr() < b for a, b in segments) for t in held]
        _run(model, opt, rank, world, range(STEPS))
        opt.param_sync()
        if rank == 0:
            out.put(dict(inside=inside, transport=opt.transports["grad_sync"],
                         params=[p.detach().cpu().numpy().copy() for p in model.parameters()]))
    _exit()


@pytest.mark.multigpu
def test_nccl_ub_buffers_are_registered_and_train_as_adamw():
    from test_distributed import _reference, _spawn
    result = _spawn(_nccl_ub_worker, 2)
    assert result["inside"] == [True, True], "the gradient buffer and shards must come from the NCCL pool"
    assert result["transport"].startswith("nccl"), result["transport"]
    for i, (got, want) in enumerate(zip(result["params"], _reference(2)[0])):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")
