"""DistributedFusedMuon on gloo ranks against FusedMuon in one process on the
global batch ([Note: matrix-atomic ownership] in distributed/_muon_owners.py).

The model has a tall and a wide Muon matrix, a 3-D expert parameter (a batch
of three matrices) and an AdamW group (biases and the output layer). Each
rank computes the mean loss of its slice of the global batch, so the
averaged gradients are the global batch's; with ns_dtype=torch.float32 the
runs then differ only by the reduction's fp32 rounding, which the
Newton-Schulz iteration carries into the update at about 1e-6 of its size.
"""
from __future__ import annotations

import contextlib
import gc
import re
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardadam
from shardadam._newton_schulz import ns_cost
from shardadam.distributed._muon_owners import SLOT_ALIGN, plan_owner_buckets
from test_distributed import _exit, _rank_group, _spawn_all, _two_by_two

STEPS, GLOBAL_BATCH = 4, 12


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 48)           # 48 x 16: tall
        self.hidden = nn.Linear(48, 40)          # 40 x 48: wide
        self.experts = nn.Parameter(torch.randn(3, 20, 40) * 0.2)
        self.head = nn.Linear(20, 1)

    def forward(self, x):
        h = torch.tanh(self.hidden(torch.tanh(self.embed(x))))
        return self.head(torch.einsum("bi,eoi->beo", h, self.experts).tanh().mean(1))


def _groups(model: _Net) -> list[dict]:
    return [dict(params=[model.embed.weight, model.hidden.weight, model.experts]),
            dict(params=[model.embed.bias, model.hidden.bias, model.head.weight, model.head.bias], use_muon=False,
                 lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)]


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 16, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 1, generator=g)


def _train(model, opt, steps, rank=0, world=1, micro=1, clip=None, scaler=None, autocast=None,
           unscale=False, zero_grad=True, accumulate="no_sync") -> list[float]:
    """Train on this rank's slice of the global batches, in `micro` pieces
    (gradients accumulated inside no_sync(), or synchronised after each one
    with accumulate="every"); the pre-clip norms when clipping. scaler: a
    GradScaler scales the loss and steps; autocast: the forward under
    torch.autocast in that dtype; unscale: clip after
    unscale_grads(grad_scaler=scaler) (else clip_grad_norm unscales);
    zero_grad=False: none after the steps (DistributedFusedMuon's step
    consumes the gradients)."""
    device = next(model.parameters()).device
    xs, ys = (t.to(device) for t in _data())
    per = GLOBAL_BATCH // world
    norms = []
    for s in steps:
        x, y = xs[s, rank * per:(rank + 1) * per], ys[s, rank * per:(rank + 1) * per]
        for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with contextlib.nullcontext() if autocast is None else torch.autocast(device.type, dtype=autocast):
                loss = nn.functional.mse_loss(model(xm).float(), ym) / micro
            with opt.no_sync() if m < micro - 1 and accumulate == "no_sync" else contextlib.nullcontext():
                (loss if scaler is None else scaler.scale(loss)).backward()
        if clip is not None:
            if not hasattr(opt, "clip_grad_norm"):  # FusedMuon: torch's clipping of unscaled gradients
                if scaler is not None:
                    scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            elif unscale:
                opt.unscale_grads(grad_scaler=scaler)
                norm = opt.clip_grad_norm(clip)
            else:
                norm = opt.clip_grad_norm(clip, grad_scaler=scaler)
            norms.append(float(norm))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if zero_grad:
            opt.zero_grad()
    return norms


OPTIONS = dict(lr=0.05, weight_decay=0.1)


def _reference(ns_dtype, steps=range(STEPS), device="cpu", clip=None, norms=None, state=None) -> list[torch.Tensor]:
    """FusedMuon's parameters after training on the global batches of
    `steps`; its pre-clip norms into `norms` and state dict into `state`."""
    model = _Net().to(device)
    opt = shardadam.FusedMuon(_groups(model), ns_dtype=ns_dtype, **OPTIONS)
    got = _train(model, opt, steps, clip=clip)
    if norms is not None:
        norms.extend(got)
    if state is not None:
        state.update(_numpy_state(opt.state_dict()))
    return [p.detach().cpu().clone() for p in model.parameters()]


def _numpy_state(sd: dict) -> dict:
    """A state dict's per-parameter tensors as numpy arrays (they travel between processes)."""
    return {i: {k: v.detach().cpu().numpy().copy() for k, v in s.items()} for i, s in sd["state"].items()}


@contextlib.contextmanager
def _rank_model(rank, world, port, cfg, out):
    """One rank's process group (NCCL on its GPU, or gloo) around a fresh _Net on its device."""
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if cuda else "gloo"):
        yield _Net().to(f"cuda:{rank}" if cuda else "cpu")


def _params(model) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def _worker(rank, world, port, cfg, out) -> None:
    with _rank_model(rank, world, port, cfg, out) as model:
        if rank != 0:  # the optimizer broadcasts rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        opt = shardadam.DistributedFusedMuon(_groups(model), ns_dtype=cfg["ns_dtype"], momentum_dtype=cfg["momentum"],
                                             overlap_grad_sync=cfg["overlap"], bucket_cap_mb=cfg["cap"],
                                             overlap_param_sync=cfg["param_overlap"], **OPTIONS,
                                             **(_two_by_two(rank) if cfg["redundant"] else {}))
        norms, reads = [], []
        for s in range(STEPS):
            norms += _train(model, opt, [s], rank, world, cfg["micro"], cfg["clip"], accumulate=cfg["accumulate"])
            if cfg["read"]:  # outside any forward, the all-gathers in flight: the first-use guard waits
                reads.append(_params(model))
        if cfg["param_overlap"]:
            opt.param_sync()
            landed = not opt._muon.param_gathers.pending and not opt._adamw._param_sync.pending
        out.put((rank, dict(norms=norms, reads=reads, landed=landed if cfg["param_overlap"] else None,
                            params=_params(model),
                            state=_numpy_state(opt.state_dict()), owned=opt.orthogonalized_matrices(),
                            buckets=len(opt._muon.buckets), adamw_shards=opt._adamw.dist_size)))
    _exit()


def _config(ns_dtype=torch.float32, overlap=True, cap=100.0, micro=1, device="cpu", clip=None, momentum=None,
            accumulate="no_sync", redundant=False, param_overlap=False, read=False):
    """redundant: 4 ranks as 2 distributed x 2 redundant (_two_by_two).
    param_overlap: overlap_param_sync=True, and param_sync() before the
    state dict; read: every parameter read after each step, outside a forward."""
    return dict(ns_dtype=ns_dtype, overlap=overlap, cap=cap, micro=micro, device=device, clip=clip,
                momentum=momentum, accumulate=accumulate, redundant=redundant, param_overlap=param_overlap, read=read)


@pytest.mark.parametrize("world,cfg", [
    (2, _config()),
    (3, _config(cap=1e-3)),                     # a bucket per parameter
    (4, _config()),                             # more ranks than matrices of some shapes
    (2, _config(overlap=False)),
    (3, _config(micro=2)),                      # no_sync accumulation
    (2, _config(micro=3, accumulate="every", cap=1e-3, clip=0.05)),  # a reduction round per micro-batch
    (2, _config(clip=0.05)),                    # clip_grad_norm over both parts, as torch's over the model
    (4, _config(redundant=True)),               # owners over {0, 1} and {2, 3}, replicated over {0, 2} / {1, 3}
    (4, _config(redundant=True, overlap=False, clip=0.05)),
    (2, _config(param_overlap=True, read=True)),                      # every read outside forward waits on first use
    (3, _config(param_overlap=True, cap=1e-3, micro=2, clip=0.05)),   # each module's forward waits for its buckets
    pytest.param(1, _config(device="cuda"), marks=pytest.mark.cuda),
    pytest.param(2, _config(device="cuda", cap=1e-3, micro=2), marks=pytest.mark.multigpu),
    pytest.param(1, _config(device="cuda", param_overlap=True, read=True), marks=pytest.mark.cuda),
    pytest.param(2, _config(device="cuda", param_overlap=True, cap=1e-3, clip=0.05), marks=pytest.mark.multigpu),
], ids=["world-2", "world-3-small-buckets", "world-4", "no-overlap", "no_sync-3", "rounds-per-micro-batch", "clip",
        "redundant-2x2", "redundant-2x2-no-overlap-clip", "overlap-param-sync-2-first-use",
        "overlap-param-sync-3-no_sync-clip", "nccl-1", "nccl-2-small-buckets", "nccl-1-overlap-param-sync",
        "nccl-2-overlap-param-sync-clip"])
def test_matches_fused_muon_on_the_global_batch(world, cfg):
    """Parameters, norms and state (Muon's update is invariant to a constant
    gradient scale, a wrong average shows in the momentum) equal FusedMuon's
    on the global batch; every rank holds the same parameters. With
    overlap_param_sync, so does every read after each step (outside a
    forward: no forward-pre hook waits for it)."""
    results = _spawn_all(_worker, world, cfg)
    want_norms, want_state = [], {}
    want = _reference(cfg["ns_dtype"], device=cfg["device"], clip=cfg["clip"], norms=want_norms, state=want_state)
    if cfg["read"]:
        for s in range(STEPS):
            after = _reference(cfg["ns_dtype"], range(s + 1), device=cfg["device"], clip=cfg["clip"])
            for r, result in enumerate(results):
                for i, (got, w) in enumerate(zip(result["reads"][s], after)):
                    torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=2e-6,
                                               msg=lambda m: f"rank {r}, read of param {i} after step {s}: {m}")
    assert all(result["landed"] is (True if cfg["param_overlap"] else None) for result in results), \
        "param_sync() left an all-gather in flight"
    if cfg["clip"] is not None:
        assert min(want_norms) > cfg["clip"], "the test must clip at every step"
        for result in results:
            torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(want_norms), rtol=1e-5, atol=0)
    for r, result in enumerate(results):
        for i, (got, w) in enumerate(zip(result["params"], want)):
            torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=2e-6,
                                       msg=lambda m: f"rank {r}, param {i}: {m}")
        assert all(np.array_equal(a, b) for a, b in zip(result["params"], results[0]["params"])), \
            f"rank {r}'s parameters differ from rank 0's"
        _assert_state_close(result["state"], want_state, f"rank {r}")
        assert result["adamw_shards"] == (2 if cfg["redundant"] else world), "the AdamW part's shards"
    if cfg["cap"] < 1:
        assert results[0]["buckets"] == 3
    # Every matrix is orthogonalized by exactly one rank of each replica set, the
    # same in each: ranks r and r + 2 are replicas of each other.
    replica_sets = [results[:2], results[2:]] if cfg["redundant"] else [results]
    for ranks in replica_sets:
        owned = [m for result in ranks for m in result["owned"]]
        assert sorted(owned, key=repr) == sorted([(0, None), (1, None), (2, 0), (2, 1), (2, 2)], key=repr)
        assert [result["owned"] for result in ranks] == [result["owned"] for result in replica_sets[0]]


def _assert_state_close(got: dict, want: dict, where: str) -> None:
    """State dicts' tensors (_numpy_state) at fp32 rounding: states span
    1e-7..1e-2, so the error is the rounding of each tensor's largest value."""
    assert got.keys() == want.keys(), f"{where}: state of parameters {sorted(got)}, want {sorted(want)}"
    for i, state in want.items():
        for k, w in state.items():
            w = torch.from_numpy(w)
            torch.testing.assert_close(torch.from_numpy(got[i][k]), w, rtol=1e-5, atol=1e-5 * float(w.abs().max()),
                                       msg=lambda m: f"{where}, state[{i}][{k}]: {m}")


def _movement_errors(got: list, want: list) -> list[float]:
    start = [p.detach() for p in _Net().parameters()]
    return [float(((g - p0) - (w - p0)).norm() / (w - p0).norm()) for g, w, p0 in zip(got, want, start)]


def test_bf16_newton_schulz_moves_the_parameters_as_fused_muon():
    """Ranks' gradients sum in another order than the global batch's, and bf16
    Newton-Schulz turns those fp32 roundings into bf16 ones: the run stays
    within half of bf16's own distance from fp32 Newton-Schulz (measured: a
    fifth of it at most, 2.2% of the movement against 12.7%; the figures vary
    with the machine's BLAS), while fp32 Newton-Schulz in its place, or a
    10% learning-rate error, lands a whole bf16 distance away."""
    results = _spawn_all(_worker, 2, _config(ns_dtype=torch.bfloat16))
    bf16 = _reference(torch.bfloat16)
    noise = max(_movement_errors(bf16, _reference(torch.float32)))
    errors = _movement_errors([torch.from_numpy(p) for p in results[0]["params"]], bf16)
    assert noise > 1e-2 and max(errors) < noise / 2, f"movement differs by {errors}; bf16 against fp32 {noise:.2e}"


def test_bf16_momentum_differs_from_fp32_by_bf16_rounding_only():
    """Momentum stored in bf16 (fp32 Newton-Schulz) moves the parameters away
    from FusedMuon's fp32 run by at most twice what bf16 Newton-Schulz alone
    does (torch's own bf16 rounding, measured here: about 5% of the movement
    on these small matrices, whose small singular directions the iteration
    amplifies), and visibly (the option is not ignored)."""
    results = _spawn_all(_worker, 2, _config(momentum=torch.bfloat16))
    fp32 = _reference(torch.float32)
    errors = _movement_errors([torch.from_numpy(p) for p in results[0]["params"]], fp32)
    noise = max(_movement_errors(_reference(torch.bfloat16), fp32))
    assert 1e-4 < max(errors) < 2 * noise, f"movement differs by {errors}; bf16 Newton-Schulz alone {noise:.2e}"


# ---------------------------------------------------------------- GradScaler
#
# Muon's update is invariant to a constant gradient scale, so a gradient left
# scaled does not move the Muon parameters differently: it shows in the
# momentum buffers, in the AdamW part and in the norms, all compared here.

INIT_SCALE = 2.0 ** 10


def _amp_config(device="cpu", inf_param=None, inf_step=None, clip=None, unscale=False, autocast=None,
                zero_grad=True, skip_nonfinite=False):
    """inf_param at inf_step: the last rank's gradient of that parameter holds
    an inf. clip, unscale, zero_grad: _train's. autocast: the forward's dtype.
    skip_nonfinite: no scaler (a disabled one), skip_nonfinite_grads=True."""
    return dict(device=device, inf_param=inf_param, inf_step=inf_step, clip=clip, unscale=unscale,
                autocast=autocast, zero_grad=zero_grad, skip_nonfinite=skip_nonfinite)


def _poisoned(param: torch.Tensor) -> list[bool]:
    """A switch: while on, the first element of param's gradient is inf
    (a tensor hook: it runs before the optimizer takes the gradient)."""
    on = [False]

    def hook(grad):
        if not on[0]:
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)  # autocast's may be strided
        grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(hook)
    return on


def _snapshot(model, opt) -> list[torch.Tensor]:
    """The parameters and every tensor of the optimizer's state dict (every rank must call it)."""
    state = opt.state_dict()["state"]
    return [p.detach().clone() for p in model.parameters()] + \
        [state[i][k].detach().clone() for i in sorted(state) for k in sorted(state[i])]


def _amp_train(model, opt, scaler, cfg, rank=0, world=1) -> dict:
    """_train under the GradScaler, one step at a time: the pre-clip norms,
    the scale after each step, and whether the inf step left the parameters
    and the optimizer state bit-unchanged (None without one)."""
    on = _poisoned(dict(model.named_parameters())[cfg["inf_param"]]) \
        if cfg["inf_param"] is not None and rank == world - 1 else [False]
    norms, scales, unchanged = [], [], None
    for s in range(STEPS):
        on[0] = s == cfg["inf_step"]
        before = _snapshot(model, opt) if s == cfg["inf_step"] else None
        norms += _train(model, opt, [s], rank, world, clip=cfg["clip"], scaler=scaler, autocast=cfg["autocast"],
                        unscale=cfg["unscale"], zero_grad=cfg["zero_grad"] or isinstance(opt, shardadam.FusedMuon))
        scales.append(scaler.get_scale())
        if before is not None:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
    return dict(norms=norms, scales=scales, unchanged=unchanged)


def _amp_worker(rank, world, port, cfg, out) -> None:
    with _rank_model(rank, world, port, cfg, out) as model:
        opt = shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32,
                                             skip_nonfinite_grads=cfg["skip_nonfinite"], **OPTIONS)
        scaler = torch.amp.GradScaler(cfg["device"], init_scale=INIT_SCALE, enabled=not cfg["skip_nonfinite"])
        got = _amp_train(model, opt, scaler, cfg, rank, world)
        out.put((rank, dict(got, params=[p.detach().cpu().numpy().copy() for p in model.parameters()],
                            state=_numpy_state(opt.state_dict()))))
    _exit()


def _amp_reference(cfg) -> tuple[list, dict, list]:
    """(parameters, state, pre-clip norms) of FusedMuon on the global batch:
    on the CPU without a scaler, leaving out the inf step (fp32 gradients
    scale by 2**10 exactly); on CUDA the same GradScaler flow (torch's own
    unscaling: autocast's fp16 gradients do not scale exactly)."""
    norms, state = [], {}
    if cfg["device"] == "cpu":
        params = _reference(torch.float32, [s for s in range(STEPS) if s != cfg["inf_step"]], clip=cfg["clip"],
                            norms=norms, state=state)
        return params, state, norms
    model = _Net().cuda()
    opt = shardadam.FusedMuon(_groups(model), ns_dtype=torch.float32, **OPTIONS)
    got = _amp_train(model, opt, torch.amp.GradScaler("cuda", init_scale=INIT_SCALE), cfg)
    return [p.detach().cpu() for p in model.parameters()], _numpy_state(opt.state_dict()), got["norms"]


@pytest.mark.parametrize("world,cfg", [
    (2, _amp_config()),
    (2, _amp_config(inf_param="hidden.weight", inf_step=2, zero_grad=False)),  # the skip ends the iteration
    (2, _amp_config(inf_param="head.bias", inf_step=2, clip=0.05, unscale=True)),
    (2, _amp_config(clip=0.05)),
    (2, _amp_config(inf_param="head.bias", inf_step=2, skip_nonfinite=True)),
    pytest.param(1, _amp_config(device="cuda", autocast=torch.float16, inf_param="experts", inf_step=2),
                 marks=pytest.mark.cuda),
    pytest.param(1, _amp_config(device="cuda", autocast=torch.bfloat16, clip=0.05), marks=pytest.mark.cuda),
], ids=["scaled", "inf-in-a-muon-matrix", "inf-in-an-adamw-param-unscale-then-clip", "clip-unscales",
        "skip-nonfinite-grads-without-a-scaler", "nccl-1-fp16-autocast-inf", "nccl-1-bf16-autocast-clip"])
def test_grad_scaler_trains_as_fused_muon_on_unscaled_gradients(world, cfg):
    """Parameters, momentum buffers and AdamW states equal FusedMuon's on the
    unscaled gradients of the global batch; an inf in one rank's gradient
    of one parameter skips the step on every rank, writing nothing, and the
    scaler backs off; clip_grad_norm returns (and clips by) the unscaled norm."""
    results = _spawn_all(_amp_worker, world, cfg)
    want, want_state, want_norms = _amp_reference(cfg)
    inf_step = cfg["inf_step"]
    scales = [1.0 if cfg["skip_nonfinite"] else INIT_SCALE / 2 if inf_step is not None and s >= inf_step
              else INIT_SCALE for s in range(STEPS)]
    if cfg["clip"] is not None:
        assert min(want_norms) > cfg["clip"], "the test must clip at every step"
    for r, result in enumerate(results):
        assert result["scales"] == scales, f"rank {r}: scales {result['scales']}"
        assert result["unchanged"] is (None if inf_step is None else True), f"rank {r} wrote in the inf step"
        if cfg["clip"] is not None:
            got_norms = [n for s, n in enumerate(result["norms"]) if s != inf_step]  # the inf step's is inf
            torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=1e-5, atol=0,
                                       msg=lambda m: f"rank {r}, norms: {m}")
        for i, (got, w) in enumerate(zip(result["params"], want)):
            torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=2e-6,
                                       msg=lambda m: f"rank {r}, param {i}: {m}")
        _assert_state_close(result["state"], want_state, f"rank {r}")


def test_scaler_unscale_is_refused_and_names_unscale_grads(one_rank):
    """scaler.unscale_(opt) cannot reach the gradients in the buckets: the
    step raises, naming the method that can, before anything is written."""
    model = _Net()
    opt = shardadam.DistributedFusedMuon(_groups(model), **OPTIONS)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    xs, ys = _data()
    scaler.scale(nn.functional.mse_loss(model(xs[0]), ys[0])).backward()
    before = _snapshot(model, opt)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"optimizer\.unscale_grads\(grad_scaler=scaler\)"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))


def _checkpoint_worker(rank, world, port, path, phase, redundant, param_overlap, out) -> None:
    """phase "save": 2 steps, state_dict() to path; "load": load it and take
    the rest. redundant: 4 ranks as 2 x 2 (_two_by_two); param_overlap:
    overlap_param_sync=True (the all-gathers of the last step before the
    save still in flight when state_dict() is called)."""
    with _rank_group(rank, world, port, out):
        model = _Net()
        opt = shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32, overlap_param_sync=param_overlap,
                                             **OPTIONS, **(_two_by_two(rank) if redundant else {}))
        if phase == "save":
            _train(model, opt, range(2), rank, world)
            sd = opt.state_dict()
            if rank == 0:
                torch.save(dict(model=model.state_dict(), optim=sd), path)
            out.put((rank, sorted(sd["state"][0])))
        else:
            saved = torch.load(path)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
            _train(model, opt, range(2, STEPS), rank, world)
            out.put((rank, [p.detach().numpy().copy() for p in model.parameters()]))
    _exit()


@pytest.mark.parametrize("load_world,redundant,param_overlap", [
    (1, False, False), (3, False, False), (4, True, False), (3, False, True),
], ids=["1", "3", "2x2-redundant", "3-overlap-param-sync"])
def test_state_dict_of_2_ranks_resumes_at_other_world_sizes(tmp_path, load_world, redundant, param_overlap):
    path = str(tmp_path / "ckpt.pt")
    keys = _spawn_all(_checkpoint_worker, 2, path, "save", False, param_overlap)
    assert keys[0] == ["momentum_buffer"]
    resumed = _spawn_all(_checkpoint_worker, load_world, path, "load", redundant, param_overlap)
    for i, (got, want) in enumerate(zip(resumed[0], _reference(torch.float32))):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=2e-6, msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("world,redundant", [(2, False), (4, True)], ids=["2", "2x2-redundant"])
def test_state_dict_loads_into_fused_muon(tmp_path, world, redundant):
    """The checkpoint is FusedMuon's: a single-process run resumes from it."""
    path = str(tmp_path / "ckpt.pt")
    _spawn_all(_checkpoint_worker, world, path, "save", redundant, False)
    saved = torch.load(path)
    model = _Net()
    model.load_state_dict(saved["model"])
    opt = shardadam.FusedMuon(_groups(model), ns_dtype=torch.float32, **OPTIONS)
    opt.load_state_dict(saved["optim"])
    _train(model, opt, range(2, STEPS))
    for i, (got, want) in enumerate(zip(model.parameters(), _reference(torch.float32))):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=2e-6, msg=lambda m: f"param {i}: {m}")


def test_owners_balance_newton_schulz_cost_and_slots_do_not_overlap():
    shapes = [(512, 128), (128, 512), (8, 256, 256), (300, 300), (64, 64), (1000, 10)]
    dtypes = [torch.float32] * len(shapes)
    for world in (1, 2, 3, 4, 7):
        buckets = plan_owner_buckets(shapes, dtypes, world, cap=200_000)
        assert len(buckets) > 1
        assert [k for b in buckets for k in b.params] == list(reversed(range(len(shapes))))
        matrices = [m for b in buckets for m in b.matrices]
        assert sorted((m.param, m.index) for m in matrices if m.index is not None) == [(2, i) for i in range(8)]
        load = [sum(m.cost for m in matrices if m.owner == r) for r in range(world)]
        largest = max(m.cost for m in matrices)
        assert max(load) - min(load) <= largest, f"world {world}: loads {load}"
        for b in buckets:
            for r in range(world):
                spans = sorted((m.offset, m.offset + m.numel) for m in b.owned_by(r))
                assert all(s % SLOT_ALIGN == 0 for s, _ in spans)
                assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
                assert all(e <= b.slot_size for _, e in spans)
    assert ns_cost((512, 128)) == ns_cost((4, 128, 512)) == 512 * 128 * 128


@pytest.mark.parametrize("bad,match", [
    (lambda m: [dict(params=[m.embed.bias])], r"has shape \(48,\).*use_muon=False"),
    (lambda m: [dict(params=[m.embed.weight], ns_steps=100)], "ns_steps"),
    (lambda m: [dict(params=[m.head.bias], use_muon=False, momentum=0.9)], "only Muon groups take"),
])
def test_bad_groups_raise_before_anything_is_written(bad, match):
    model = _Net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        shardadam.DistributedFusedMuon(bad(model))
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


def _bad_layout_worker(rank, world, port, out) -> None:
    """2 ranks: groups that do not cover process_group (each rank its own
    distributed group and no redundant group; a redundant group of both and
    no distributed group), with and without AdamW groups, and
    DistributedFusedAdam on the same groups: every refusal's message, and
    whether the parameters (rank 1's differ from rank 0's, which the
    broadcast would write) are untouched."""
    with _rank_group(rank, world, port, out):
        model = _Net()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
        before = [p.detach().clone() for p in model.parameters()]
        alone, both = [dist.new_group([0]), dist.new_group([1])][rank], dist.new_group([0, 1])
        messages = []
        for layout in (dict(distributed_process_group=alone), dict(redundant_process_group=both)):
            for make in (lambda: shardadam.DistributedFusedMuon(_groups(model)[:1], **layout),
                         lambda: shardadam.DistributedFusedMuon(_groups(model), **layout),
                         lambda: shardadam.DistributedFusedAdam(model.parameters(), **layout)):
                try:
                    make()
                    messages.append(None)
                except ValueError as e:
                    messages.append(str(e))
        out.put((rank, dict(messages=messages,
                            unchanged=all(torch.equal(a, p) for a, p in zip(before, model.parameters())))))
    _exit()


def test_groups_that_do_not_cover_the_process_group_are_refused_before_anything_is_written():
    """DistributedFusedAdam's check of distributed_process_group x
    redundant_process_group, on both parts, before the broadcast."""
    results = _spawn_all(_bad_layout_worker, 2)
    cover = r"distributed_process_group \({} ranks\) x redundant_process_group \({} ranks\) must cover process_group " \
            r"\(2 ranks\): pass both"
    for rank, result in enumerate(results):
        assert result["unchanged"], f"rank {rank}'s parameters were written"
        for i, (message, sizes) in enumerate(zip(result["messages"], [(1, 1)] * 3 + [(2, 2)] * 3)):
            assert message is not None and re.match(cover.format(*sizes), message), f"rank {rank}, case {i}: {message}"


def test_options_not_offered_are_refused_by_name():
    model = _Net()
    with pytest.raises(ValueError, match="capturable"):
        shardadam.DistributedFusedMuon(_groups(model), capturable=True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_no_gradient_outlives_zero_grad(one_rank, overlap):
    """The optimizer copies gradients into its buckets and keeps no reference
    to them: after step() and zero_grad(set_to_none=True) every gradient of
    the last step is gone, as with torch.optim."""
    model = _Net()
    refs = []
    for p in model.parameters():  # registered first: runs before the optimizer's hand-over
        p.register_post_accumulate_grad_hook(lambda p: refs.append(weakref.ref(p.grad)))
    opt = shardadam.DistributedFusedMuon(_groups(model), overlap_grad_sync=overlap, **OPTIONS)
    xs, ys = _data()
    for s in range(2):
        refs.clear()
        nn.functional.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        assert len(refs) == 7 and not any(r() is not None for r in refs), "a gradient outlived zero_grad"


def test_zero_grad_discards_the_gradients_backward_handed_over(one_rank):
    """With overlap_grad_sync the gradients are in the buckets after backward;
    zero_grad() discards them there too, so the next step sees only the
    gradients of the backward after it (FusedMuon's step on that batch)."""
    model = _Net()
    opt = shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32, **OPTIONS)
    xs, ys = _data()
    nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    opt.zero_grad()
    _train(model, opt, [1])
    for i, (got, want) in enumerate(zip(model.parameters(), _reference(torch.float32, [1]))):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=2e-6, msg=lambda m: f"param {i}: {m}")


def test_backward_after_the_gradients_were_reduced_is_refused(one_rank):
    """grad_norm() reduced this iteration's Muon gradients: a further backward
    before step() would miss the step, and raises saying so."""
    model = _Net()
    opt = shardadam.DistributedFusedMuon(_groups(model)[:1], **OPTIONS)
    xs, ys = _data()
    nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    opt.grad_norm()
    with pytest.raises(RuntimeError, match="^DistributedFusedMuon: a backward after the gradients were reduced"):
        nn.functional.mse_loss(model(xs[1]), ys[1]).backward()
