"""FusedAdam / FusedLion on FSDP2 (fully_shard) models: DTensor parameters.

Two gloo ranks on the CPU (NCCL on two GPUs: multigpu) run every check in one
spawn (_fsdp_worker): each variant trains the same FSDP2 model with a
shardadam optimizer and with its independent reference (torch.optim.AdamW
with foreach=False, TorchLion, AdamW on fp32 master copies for bf16
parameters) and compares the local shards. The model has a layer whose
weight has fewer rows than there are ranks, so rank 1 owns an empty shard.
Checkpoints go through torch.distributed.checkpoint (get/set_optimizer_state_dict,
dcp.save/load) and reshard to another placement on two ranks and to one rank
(in the test process).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import shardadam
from test_distributed import _exit, _rank_group, _spawn_all
from torch_lion import TorchLion

STEPS, SAVED_AT, GLOBAL_BATCH = 4, 2, 8
LR = 1e-2
F32_TOL = dict(rtol=1e-5, atol=1e-6)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 6, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 1, generator=g)


def _model(mesh, dtype=torch.float32, mp=None, placement=None) -> nn.Module:
    """Uneven on 2 ranks: the last layer's weight (1, 3) and bias (1,) leave rank 1 an empty shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    model = model.to(mesh.device_type, dtype)
    kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    if placement is not None:
        # FSDP2 shards only dim 0 unevenly: other dims where they divide evenly
        kw["shard_placement_fn"] = lambda p: Shard(placement) if p.dim() > placement and p.shape[
            placement] % mesh.size() == 0 else None
    for layer in model[::2]:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _groups(model: nn.Module) -> list[dict]:
    return [dict(params=[p for p in model.parameters() if p.dim() >= 2], weight_decay=0.1),
            dict(params=[p for p in model.parameters() if p.dim() < 2], weight_decay=0.0, lr=2 * LR)]


def _train(model, opt, steps, rank: int, world: int, hook=None) -> None:
    """This rank's part of each global batch; FSDP2 averages the gradients.
    hook(step, model) runs between backward and the optimizer step."""
    x, y = _data()
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    local = GLOBAL_BATCH // world
    for s in steps:
        opt.zero_grad()
        part = slice(rank * local, (rank + 1) * local)
        F.mse_loss(model(x[s, part].to(dev, dtype)).float(), y[s, part].to(dev)).backward()
        if hook is not None:
            hook(s, model)
        opt.step()


def _locals(tensors) -> list[torch.Tensor]:
    return [t.detach().to_local().float().cpu() for t in tensors]


class _Checks:
    """Named comparisons on one rank: None when a check passed, else its message."""

    def __init__(self):
        self.results = {}

    def close(self, name: str, got, want, **tol) -> None:
        try:
            torch.testing.assert_close(got, want, **(tol or F32_TOL))
        except AssertionError as e:
            self.results[name] = str(e)
        else:
            self.results.setdefault(name, None)

    def true(self, name: str, ok: bool, why: str) -> None:
        if not ok:
            self.results[name] = why
        else:
            self.results.setdefault(name, None)

    def raises(self, name: str, fn, *needles: str) -> None:
        try:
            fn()
        except ValueError as e:
            missing = [n for n in needles if n not in str(e)]
            self.true(name, not missing, f"the message lacks {missing}: {e}")
        else:
            self.results[name] = "did not raise ValueError"


class _MasterAdamW:
    """The reference for bf16 parameters with fp32 masters: torch AdamW on fp32
    copies of the DTensor parameters, the parameters set to the rounded masters."""

    def __init__(self, model, **kw):
        self.pairs = [(p, nn.Parameter(p.detach().float())) for p in model.parameters()]
        masters = {id(p): m for p, m in self.pairs}
        groups = [dict(g, params=[masters[id(p)] for p in g["params"]]) for g in _groups(model)]
        self.opt = torch.optim.AdamW(groups, foreach=False, **kw)

    def zero_grad(self):
        for p, m in self.pairs:
            p.grad = m.grad = None

    @torch.no_grad()
    def step(self):
        for p, m in self.pairs:
            m.grad = p.grad.float()
        self.opt.step()
        for p, m in self.pairs:
            p.copy_(m)


def _variants(mesh, rank: int, world: int, checks: _Checks) -> None:
    """Each shardadam configuration against its reference, on the same FSDP2 model."""
    adamw = dict(lr=LR, betas=(0.9, 0.99))
    f32 = torch.float32
    cases = {
        "adamw": (f32, None, lambda g: shardadam.FusedAdam(g, **adamw),
                  lambda g: torch.optim.AdamW(g, foreach=False, **adamw)),
        "adam-l2": (f32, None, lambda g: shardadam.FusedAdam(g, adam_w_mode=False, **adamw),
                    lambda g: torch.optim.Adam(g, foreach=False, **adamw)),
        "amsgrad-maximize": (f32, None, lambda g: shardadam.FusedAdam(g, amsgrad=True, maximize=True, **adamw),
                             lambda g: torch.optim.AdamW(g, foreach=False, amsgrad=True, maximize=True, **adamw)),
        "flat-grads": (f32, None, lambda g: shardadam.FusedAdam(g, flat_grads=True, **adamw),
                       lambda g: torch.optim.AdamW(g, foreach=False, **adamw)),
        "lion": (f32, None, lambda g: shardadam.FusedLion(g, lr=LR), lambda g: TorchLion(g, lr=LR)),
        # FSDP2 keeps fp32 sharded parameters and gradients; compute in bf16
        "mixed-precision-policy": (f32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=f32),
                                   lambda g: shardadam.FusedAdam(g, **adamw),
                                   lambda g: torch.optim.AdamW(g, foreach=False, **adamw)),
    }
    for name, (dtype, mp, make, make_ref) in cases.items():
        model, ref = _model(mesh, dtype, mp), _model(mesh, dtype, mp)
        opt, ref_opt = make(_groups(model)), make_ref(_groups(ref))
        _train(model, opt, range(STEPS), rank, world)
        _train(ref, ref_opt, range(STEPS), rank, world)
        checks.close(f"{name}: params", _locals(model.parameters()), _locals(ref.parameters()))
        checks.true(f"{name}: sharded parameters stay fp32", all(p.dtype == f32 for p in model.parameters()),
                    str({p.dtype for p in model.parameters()}))
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in ref_opt.state[next(ref.parameters())]:
                checks.close(f"{name}: {k}", _locals(opt.state[p][k] for p in model.parameters()),
                             _locals(ref_opt.state[p][k] for p in ref.parameters()))

    # bf16 sharded parameters: fp32 masters, or remainders (the same exact master)
    bf16 = {}
    for name, kw in {"master-weights": dict(master_weights=True),
                     "remainders": dict(store_param_remainders=True)}.items():
        model, ref = _model(mesh, torch.bfloat16), _model(mesh, torch.bfloat16)
        opt, ref_opt = shardadam.FusedAdam(_groups(model), **adamw, **kw), _MasterAdamW(ref, **adamw)
        _train(model, opt, range(STEPS), rank, world)
        _train(ref, ref_opt, range(STEPS), rank, world)
        saved = opt.state_dict()["state"]  # keyed in param_groups order
        checks.close(f"{name}: masters", _locals(saved[i]["master_param"] for i in range(len(saved))),
                     _locals(m for g in ref_opt.opt.param_groups for m in g["params"]))
        # one bf16 ulp: a master within fp32 rounding of the reference's may round the other way
        checks.close(f"{name}: bf16 params", _locals(model.parameters()), _locals(ref.parameters()), rtol=2 ** -7,
                     atol=1e-6)
        bf16[name] = _locals(model.parameters())
    checks.close("remainders equal fp32 masters bit for bit", bf16["remainders"], bf16["master-weights"],
                 rtol=0, atol=0)

    # 16-bit states (fp16 with a scale per local piece): close to the fp32 run, stored as 16-bit DTensors
    for dtype, tol in ((torch.bfloat16, dict(rtol=2e-2, atol=2e-4)), (torch.float16, dict(rtol=2e-3, atol=2e-5))):
        model, ref = _model(mesh), _model(mesh)
        opt = shardadam.FusedAdam(_groups(model), exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, **adamw)
        _train(model, opt, range(STEPS), rank, world)
        _train(ref, torch.optim.AdamW(_groups(ref), foreach=False, **adamw), range(STEPS), rank, world)
        checks.close(f"16-bit states {dtype}: params", _locals(model.parameters()), _locals(ref.parameters()), **tol)
        checks.true(f"16-bit states {dtype} are DTensors of that dtype", all(
            isinstance(s["exp_avg"], DTensor) and s["exp_avg"].dtype == dtype for s in opt.state.values()),
            "a state is not")

    # skip_nonfinite_grads: an inf in rank 0's shard only; both ranks skip that step
    def inf_on_rank_0(s, m):
        if s == 1 and rank == 0:
            with torch.no_grad():
                m[0].weight.grad.to_local()[0, 0] = float("inf")

    def skip_step_1(s, m):
        if s == 1:
            for p in m.parameters():
                p.grad = None  # torch.optim then leaves every parameter alone

    model, ref = _model(mesh), _model(mesh)
    opt = shardadam.FusedAdam(_groups(model), skip_nonfinite_grads=True, **adamw)
    _train(model, opt, range(STEPS), rank, world, inf_on_rank_0)
    _train(ref, torch.optim.AdamW(_groups(ref), foreach=False, **adamw), range(STEPS), rank, world, skip_step_1)
    checks.true("skip-nonfinite: every rank skipped once", opt.skipped_steps == 1,
                f"rank {rank} skipped {opt.skipped_steps} steps")
    checks.close("skip-nonfinite: params", _locals(model.parameters()), _locals(ref.parameters()))

    # a parameter without a gradient is left alone, as torch.optim does (never given one here: FusedAdam's
    # bias correction counts the group's steps, torch's the parameter's)
    def no_grad_for_last_bias(s, m):
        m[4].bias.grad = None

    model, ref = _model(mesh), _model(mesh)
    opt = shardadam.FusedAdam(_groups(model), **adamw)
    _train(model, opt, range(STEPS), rank, world, no_grad_for_last_bias)
    _train(ref, torch.optim.AdamW(_groups(ref), foreach=False, **adamw), range(STEPS), rank, world,
           no_grad_for_last_bias)
    checks.close("missing gradients: params", _locals(model.parameters()), _locals(ref.parameters()))

    # state[p]: DTensors of p's mesh and placements, views into one flat buffer
    model = _model(mesh)
    opt = shardadam.FusedAdam(_groups(model), **adamw)
    _train(model, opt, range(1), rank, world)
    states = [opt.state[p] for p in model.parameters()]
    checks.true("state[p] are DTensors laid out as p", all(
        isinstance(s[k], DTensor) and s[k].placements == p.placements and s[k].device_mesh == p.device_mesh
        and s[k].shape == p.shape and s[k].to_local().shape == p.to_local().shape
        for p, s in zip(model.parameters(), states) for k in ("exp_avg", "exp_avg_sq")), "a state is not")
    storages = {s["exp_avg"].to_local().untyped_storage().data_ptr() for s in states}
    checks.true("state[p] share one flat buffer", len(storages) == 1, f"{len(storages)} storages")

    # refusals
    checks.raises("DistributedFusedAdam refuses DTensors", lambda: shardadam.DistributedFusedAdam(
        model.parameters()), "already sharded", "shardadam.FusedAdam")
    plain = [dict(g, params=[nn.Parameter(p.full_tensor()) for p in g["params"]]) for g in _groups(model)]
    checks.raises("a DTensor state for a plain parameter", lambda: shardadam.FusedAdam(plain).load_state_dict(
        opt.state_dict()), "is a DTensor", "plain tensor")
    other = _model(mesh, placement=1)
    other_opt = shardadam.FusedAdam(_groups(other), **adamw)
    _train(other, other_opt, range(1), rank, world)
    checks.raises("another placement", lambda: opt.load_state_dict(other_opt.state_dict()), "laid out as",
                  "torch.distributed.checkpoint")
    weight = model[0].weight
    weight.grad = weight.detach().redistribute(placements=[Replicate()])  # global shape fits, local pieces do not
    before = _locals(model.parameters())
    checks.raises("a gradient of other placements", opt.step, "laid out as", "Replicate")
    checks.close("a gradient of other placements changes nothing", _locals(model.parameters()), before, rtol=0,
                 atol=0)
    partial = nn.Parameter(DTensor.from_local(torch.ones(2, device=mesh.device_type), mesh, [Partial()]))
    checks.raises("a Partial parameter", lambda: shardadam.FusedAdam([partial]), "Partial")


def _checkpoints(mesh, rank: int, world: int, path: str, checks: _Checks) -> dict:
    """dcp.save at SAVED_AT, the run continued to STEPS; loads into another
    placement on these ranks; torch AdamW's state dicts (sharded and full)
    into FusedAdam. Returns the full parameters after STEPS."""
    adamw = dict(lr=LR, betas=(0.9, 0.99))
    model = _model(mesh)
    opt = shardadam.FusedAdam(_groups(model), **adamw)
    _train(model, opt, range(SAVED_AT), rank, world)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    _train(model, opt, range(SAVED_AT, STEPS), rank, world)
    final = [p.detach().full_tensor().cpu() for p in model.parameters()]

    resharded = _model(mesh, placement=1)  # dim 1 sharded instead of dim 0
    resharded_opt = shardadam.FusedAdam(_groups(resharded), **adamw)
    _load(resharded, resharded_opt, path)
    checks.true("the resharded optimizer's step", resharded_opt.param_groups[0]["step"] == SAVED_AT,
                f"step {resharded_opt.param_groups[0]['step']}")
    _train(resharded, resharded_opt, range(SAVED_AT, STEPS), rank, world)
    checks.close("dcp.load into another placement continues the run",
                 [p.detach().full_tensor().cpu() for p in resharded.parameters()], final)

    # torch AdamW's state dicts into FusedAdam: sharded through set_optimizer_state_dict, full (FQN keys,
    # whole tensors on every rank) through load_state_dict; FusedAdam's own full one through both
    ref = _model(mesh)
    ref_opt = torch.optim.AdamW(_groups(ref), foreach=False, **adamw)
    _train(ref, ref_opt, range(SAVED_AT), rank, world)
    dcp.save({"model": get_model_state_dict(ref), "optim": get_optimizer_state_dict(ref, ref_opt)},
             checkpoint_id=_torch_path(path))
    full = StateDictOptions(full_state_dict=True)
    sharded, whole = get_optimizer_state_dict(ref, ref_opt), get_optimizer_state_dict(ref, ref_opt, options=full)
    loaded = {}
    for name in ("sharded", "full", "fused-full"):
        loaded[name] = (_model(mesh), None)
        model_, _ = loaded[name]
        set_model_state_dict(model_, get_model_state_dict(ref))
        opt_ = shardadam.FusedAdam(_groups(model_), **adamw)
        if name == "sharded":
            set_optimizer_state_dict(model_, opt_, sharded)
        elif name == "full":
            opt_.load_state_dict(whole)
            mine = get_optimizer_state_dict(model_, opt_, options=full)
            checks.true("full state dicts have torch's keys", set(mine["state"]) == set(whole["state"]),
                        f"{sorted(mine['state'])} != {sorted(whole['state'])}")
            for fqn, entry in whole["state"].items():
                for k in ("exp_avg", "exp_avg_sq"):
                    checks.close(f"full state dict round trip {fqn}.{k}", mine["state"][fqn][k], entry[k],
                                 rtol=0, atol=0)
        else:
            set_optimizer_state_dict(model_, opt_, get_optimizer_state_dict(loaded["full"][0], loaded["full"][1],
                                                                            options=full), options=full)
        loaded[name] = (model_, opt_)
    # Through DCP ([Note: torch.optim's checkpoint schema] in _rules.py): torch AdamW's checkpoint into
    # FusedAdam's own keys, a partial load (which would keep FusedAdam's values where keys differ) too
    for name, planner in (("dcp", None), ("dcp-partial", DefaultLoadPlanner(allow_partial_load=True))):
        model_ = _model(mesh)
        opt_ = shardadam.FusedAdam(_groups(model_), **adamw)
        _load(model_, opt_, _torch_path(path), planner)
        loaded[name] = (model_, opt_)
    for name, (model_, opt_) in loaded.items():
        _train(model_, opt_, range(SAVED_AT, STEPS), rank, world)
    _train(ref, ref_opt, range(SAVED_AT, STEPS), rank, world)
    # and FusedAdam's checkpoint into torch AdamW's keys
    adamw_from_fused = _model(mesh)
    adamw_from_fused_opt = torch.optim.AdamW(_groups(adamw_from_fused), foreach=False, **adamw)
    _load(adamw_from_fused, adamw_from_fused_opt, path)
    checks.true("dcp.load of FusedAdam's checkpoint into torch AdamW: its step",
                all(s["step"].item() == SAVED_AT for s in adamw_from_fused_opt.state.values()),
                f"steps {[s['step'].item() for s in adamw_from_fused_opt.state.values()]}")
    _train(adamw_from_fused, adamw_from_fused_opt, range(SAVED_AT, STEPS), rank, world)
    checks.close("dcp.load of FusedAdam's checkpoint into torch AdamW continues the run",
                 [p.detach().full_tensor().cpu() for p in adamw_from_fused.parameters()], final)
    for name, (model_, _) in loaded.items():
        checks.close(f"torch AdamW's state dicts continue in FusedAdam ({name})", _locals(model_.parameters()),
                     _locals(ref.parameters()))

    # state_dict() / load_state_dict() on the optimizer itself: DTensor values, local pieces copied
    again = shardadam.FusedAdam(_groups(_model(mesh)), **adamw)
    again.load_state_dict(opt.state_dict())
    def states(entries) -> list:  # DTensor states; the step per parameter is a plain tensor, as torch's
        return [(_locals(v for k, v in e.items() if k != "step"), e["step"]) for e in entries.values()]

    checks.close("load_state_dict(state_dict()) round trip", states(again.state_dict()["state"]),
                 states(opt.state_dict()["state"]), rtol=0, atol=0)
    return dict(final=[t.numpy() for t in final],
                torch_final=[p.detach().full_tensor().cpu().numpy() for p in ref.parameters()])


def _torch_path(path: str) -> str:
    """Where torch AdamW's DCP checkpoint of the same run goes."""
    return f"{path}/torch-adamw"


def _load(model, opt, path: str, planner=None) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _fsdp_worker(rank: int, world: int, port: int, device: str, path: str, out) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        mesh = init_device_mesh(device, (world,))
        checks = _Checks()
        _variants(mesh, rank, world, checks)
        result = _checkpoints(mesh, rank, world, path, checks)
        result["checks"] = checks.results
        out.put((rank, result))
    _exit()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.multigpu)])
def two_ranks(request, tmp_path_factory):
    """Both ranks' results of one spawn (every check below reads it) and the checkpoint's path."""
    path = str(tmp_path_factory.mktemp(f"dcp-{request.param}"))
    return _spawn_all(_fsdp_worker, 2, request.param, path), path, request.param


CHECKS = ["adamw", "adam-l2", "amsgrad-maximize", "missing gradients", "flat-grads", "lion", "mixed-precision-policy"]


@pytest.mark.parametrize("variant", CHECKS)
def test_fsdp2_training_matches_the_torch_reference(two_ranks, variant):
    _assert_checks(two_ranks, variant + ":")


@pytest.mark.parametrize("prefix", ["master-weights", "remainders"])
def test_bf16_sharded_params_with_masters_match_fp32_adamw(two_ranks, prefix):
    _assert_checks(two_ranks, prefix)


@pytest.mark.parametrize("prefix", ["16-bit states", "skip-nonfinite", "state[p]"])
def test_fsdp2_state_and_options(two_ranks, prefix):
    _assert_checks(two_ranks, prefix)


@pytest.mark.parametrize("prefix", ["DistributedFusedAdam refuses", "a DTensor state", "another placement",
                                    "a gradient of other placements",
                                    "a Partial parameter"])
def test_fsdp2_refusals(two_ranks, prefix):
    _assert_checks(two_ranks, prefix)


@pytest.mark.parametrize("prefix", ["the resharded", "dcp.load", "torch AdamW's", "full state dict",
                                    "load_state_dict(state_dict())"])
def test_fsdp2_checkpoints(two_ranks, prefix):
    _assert_checks(two_ranks, prefix)


def _assert_checks(two_ranks, prefix: str) -> None:
    results, _, _ = two_ranks
    seen = 0
    for rank, result in enumerate(results):
        for name, failure in result["checks"].items():
            if name.startswith(prefix):
                seen += 1
                assert failure is None, f"rank {rank}: {name}: {failure}"
    assert seen >= len(results), f"no check named {prefix!r} ran"


def test_dcp_checkpoint_of_2_ranks_continues_on_1(two_ranks):
    """The checkpoints saved by 2 ranks load into a 1-rank FSDP2 model (this
    process) and continue on the global batch as the 2 ranks did: FusedAdam's
    into FusedAdam and into torch AdamW, torch AdamW's into FusedAdam."""
    results, path, device = two_ranks
    if device == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        got = {}
        # FusedAdam's checkpoint into FusedAdam and into torch AdamW, torch AdamW's into FusedAdam
        for name, checkpoint, make in (("final", path, shardadam.FusedAdam),
                                       ("final", path, lambda g, **kw: torch.optim.AdamW(g, foreach=False, **kw)),
                                       ("torch_final", _torch_path(path), shardadam.FusedAdam)):
            model = _model(mesh)
            opt = make(_groups(model), lr=LR, betas=(0.9, 0.99))
            _load(model, opt, checkpoint)
            _train(model, opt, range(SAVED_AT, STEPS), 0, 1)
            got.setdefault(name, []).append([p.detach().full_tensor().cpu() for p in model.parameters()])
    finally:
        dist.destroy_process_group()
    for name, runs in got.items():
        for run in runs:
            torch.testing.assert_close(run, [torch.from_numpy(np.asarray(t)) for t in results[0][name]], **F32_TOL)


# ---------------------------------------------------------------- one GPU: a captured step

@pytest.mark.cuda
def test_captured_step_on_local_shards_equals_eager():
    """capturable=True on a 1-rank NCCL FSDP2 model: opt.step() captured in a
    CUDA graph and replayed after each eager forward/backward equals the
    eager capturable step (gradients kept in place with
    zero_grad(set_to_none=False), so FSDP2 accumulates into them)."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        mesh = init_device_mesh("cuda", (1,))
        models = [_model(mesh), _model(mesh)]
        opts = [shardadam.FusedAdam(_groups(m), lr=LR, capturable=True) for m in models]
        x, y = _data()
        x, y = x.cuda(), y.cuda()

        def forward_backward(model, opt, s):
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(x[s]), y[s]).backward()

        for s in range(2):  # warm-up: gradients, state and the plan exist before capture
            for model, opt in zip(models, opts):
                forward_backward(model, opt, s)
                opt.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opts[0].step()
        assert opts[0].param_groups[0]["step"].item() == 2, "capture must not run the step"
        for s in range(2, STEPS):
            forward_backward(models[0], opts[0], s)
            graph.replay()
            forward_backward(models[1], opts[1], s)
            opts[1].step()
        torch.cuda.synchronize()
        assert opts[0].param_groups[0]["step"].item() == STEPS
        for p, q in zip(models[0].parameters(), models[1].parameters()):  # the same kernels on the same values
            torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opts[0].state[p]["exp_avg"].to_local(), opts[1].state[q]["exp_avg"].to_local(),
                                       rtol=1e-6, atol=1e-7)
        assert not torch.equal(models[0][0].weight.to_local(), _model(mesh)[0].weight.to_local())
    finally:
        dist.destroy_process_group()
