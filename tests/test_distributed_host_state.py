"""DistributedFusedAdam / DistributedFusedLion with state_device="cpu"
([Note: host shards] in distributed/_host_shards.py).

On the CPU the state is in host memory anyway, so state_device="cpu" changes
nothing there; these tests force the host pipeline on gloo (host rows of their
own, a plan per bucket, gradients copied down and parameters copied up) and
compare it with the ordinary optimizer, bit for bit: the same kernels over the
same values. On a GPU (NCCL, one rank) the host step is compared with the
GPU-state optimizer (the same element math, compiled for two processors).
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import shardadam
from shardadam.distributed import _host_shards
from test_distributed import (STEPS, _distributed, _exit, _frozen, _groups, _lr_schedule, _model, _rank_group,
                              _spawn, _train, _two_by_two)

# name -> (optimizer options, training options, model dtype)
CASES = {
    "fp32-clip-scaler-skip": (dict(), dict(clip=0.02, scaler=True, inf_step=2), torch.float32),
    "fp32-rounds": (dict(pipeline_size=1), dict(micro=2, accumulate="every"), torch.float32),
    "fp32-no_sync": (dict(), dict(micro=2), torch.float32),
    "store-params": (dict(store_params=True), dict(), torch.float32),
    "contiguous-both-overlap": (dict(contiguous_param_buffer=True, contiguous_grad_buffer=True,
                                     overlap_param_sync=True), dict(model="reordered"), torch.float32),
    "bf16-sync": (dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16), dict(), torch.float32),
    "bf16-master": (dict(), dict(), torch.bfloat16),
    "bf16-remainders": (dict(store_params=False, store_param_remainders=True), dict(), torch.bfloat16),
    "scaled-fp16": (dict(dtype=torch.float16, with_scaled_states=True), dict(), torch.float32),
    "8-bit-amsgrad": (dict(exp_avg_dtype="blockwise8", exp_avg_sq_dtype="blockwise8", amsgrad=True), dict(),
                      torch.float32),
    "fp8": (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), dict(), torch.float32),
    "lion-8-bit": (dict(optimizer="lion", exp_avg_dtype="blockwise8"), dict(), torch.float32),
    # lr as a one-element tensor on the parameters' device, filled in place by
    # the schedule: a host step reads it on the host.
    "fp32-device-lr": (dict(), dict(tensor_lr=True), torch.float32),
}


def _build(case: str, state_device, device: str, rank: int, **extra):
    options, training, dtype = CASES[case]
    options = dict(options, **extra)
    cfg = dict(optimizer=options.pop("optimizer", "adam"), amsgrad=options.pop("amsgrad", False))
    model = _model(training.get("model", "sequential")).to(device if device == "cpu" else f"cuda:{rank}",
                                                           dtype=dtype)
    frozen = _frozen(model)
    frozen.requires_grad_(False)
    return model, _distributed(cfg, _groups(model, frozen), bucket_cap_mb=1e-4, state_device=state_device,
                               **options)


def _run(case: str, model, opt, rank: int, world: int, steps) -> None:
    training = dict(CASES[case][1])
    training.pop("model", None)
    scaler = torch.amp.GradScaler(opt.device.type, init_scale=2.0 ** 10) if training.pop("scaler", False) else None
    if training.pop("tensor_lr", False):
        for g in opt.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]), device=opt.device)
    _train(model, opt, rank, world, steps, scaler=scaler, schedule=_lr_schedule(opt), **training)
    opt.param_sync()


def _snapshot(model, opt) -> dict:
    """The parameters and the portable state (true fp32 values), as numpy arrays (a collective)."""
    state = opt.state_dict()["state"]
    return dict(params=[p.detach().float().cpu().numpy().copy() for p in model.parameters()],
                state={(k, name): v.float().cpu().numpy().copy() for k, entry in state.items()
                       for name, v in entry.items() if isinstance(v, torch.Tensor)},
                steps=[int(g["step"]) for g in opt.param_groups])


def _same_param(case: str, loaded: torch.Tensor, saved: torch.Tensor) -> bool:
    """A loaded parameter is its saved value: the master as the all-gather
    sends it. A scaled fp16 master is lossy: the step sent the fp32 value it
    rounded, the checkpoint holds the rounded one."""
    if case == "scaled-fp16":
        return torch.allclose(loaded, saved, rtol=2 ** -10, atol=0)
    return torch.equal(loaded, saved)


def _differences(got: dict, want: dict, exact: bool) -> list[str]:
    """What differs between two snapshots: bit patterns when exact, else
    more than fp32 rounding over a few steps."""
    problems = []
    if got["steps"] != want["steps"]:
        problems.append(f"steps {got['steps']} != {want['steps']}")
    pairs = [(f"param {i}", a, b) for i, (a, b) in enumerate(zip(got["params"], want["params"]))]
    pairs += [(f"state {key}", got["state"][key], want["state"][key]) for key in sorted(want["state"])]
    if sorted(got["state"]) != sorted(want["state"]):
        problems.append(f"state keys {sorted(got['state'])} != {sorted(want['state'])}")
    for what, a, b in pairs:
        same = np.array_equal(a.view(np.int32), b.view(np.int32)) if exact else \
            np.allclose(a, b, rtol=1e-5, atol=1e-6)
        if not same:
            problems.append(f"{what}: largest difference {np.abs(a - b).max()}")
    return problems


def _pair_worker(rank: int, world: int, port: int, cases: list, device: str, path: str, out) -> None:
    """Each case trained twice on the same batches, with the state on the
    device and with state_device="cpu" (forced through the host pipeline on
    the CPU); then the host-state optimizer's two checkpoint formats, each
    loaded into a fresh optimizer of both kinds that trains on. Loading must
    give the model the parameters it had when saved."""
    import torch.distributed.checkpoint as dcp
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        if device == "cpu":
            _host_shards.runs_pipeline = lambda where: True  # this process only: force the pipeline
        exact = device == "cpu"
        report = {}
        for case in cases:
            problems = []
            model, opt = _build(case, None, device, rank)
            _run(case, model, opt, rank, world, range(3))
            host_model, host_opt = _build(case, "cpu", device, rank)
            if host_opt._host is None or host_opt.shard_state_device.type != "cpu":
                problems.append("the host pipeline did not run")
            _run(case, host_model, host_opt, rank, world, range(3))
            problems += _differences(_snapshot(host_model, host_opt), _snapshot(model, opt), exact)
            # Both formats, saved by the host-state optimizer, loaded into fresh
            # optimizers of both kinds (loading starts a new layout: the
            # optimizer that trains on is not the reference), which then train on.
            where = os.path.join(path, case)
            saved_params = [p.detach().clone() for p in host_model.parameters()]
            portable = host_opt.state_dict()
            dcp.save({"optim": host_opt.sharded_state_dict()}, checkpoint_id=where)
            for fmt in ("portable", "dcp"):
                runs = {}
                for state_device in (None, "cpu"):
                    loaded_model, loaded = _build(case, state_device, device, rank)
                    if fmt == "dcp":
                        state = {"optim": loaded.sharded_state_dict()}
                        dcp.load(state, checkpoint_id=where)
                        loaded.load_sharded_state_dict(state["optim"])
                    else:
                        loaded.load_state_dict(portable)
                    loaded.param_sync()
                    problems += [f"{fmt} load ({state_device}): param {i} differs from the saved model's"
                                 for i, (a, b) in enumerate(zip(loaded_model.parameters(), saved_params))
                                 if not _same_param(case, a.detach(), b)]
                    _run(case, loaded_model, loaded, rank, world, range(3, STEPS))
                    runs[state_device] = _snapshot(loaded_model, loaded)
                problems += [f"{fmt} checkpoint: {p}" for p in _differences(runs["cpu"], runs[None], exact)]
            report[case] = problems
        if rank == 0:
            out.put(report)
    _exit()


# Three configurations per world: each rank's body stays far inside RANK_TIMEOUT_S on a slow machine.
@pytest.mark.parametrize("cases", [
    ["fp32-clip-scaler-skip", "fp32-rounds", "fp32-no_sync"],
    ["store-params", "contiguous-both-overlap", "bf16-sync"],
    ["bf16-master", "bf16-remainders", "scaled-fp16"],
    ["8-bit-amsgrad", "fp8", "lion-8-bit"],
], ids=["fp32-sync-options", "fp32-buffers-and-sync-dtypes", "16-bit-kinds", "8-bit-kinds"])
def test_forced_host_shards_give_the_same_bits(cases, tmp_path):
    report = _spawn(_pair_worker, 2, cases, "cpu", str(tmp_path))
    assert report == {case: [] for case in cases}


def _redundant_worker(rank: int, world: int, port: int, out) -> None:
    """4 ranks: shards over {0, 1} and {2, 3}, each repeated over {0, 2} / {1, 3}.
    The host pipeline against the device state with rounds of gradients; and,
    accumulating in no_sync(), stepped during backward against stepped in
    step() (with a redundant group every bucket is handed over in step(),
    after the replicas' all-reduce)."""
    with _rank_group(rank, world, port, out):
        _host_shards.runs_pipeline = lambda where: True
        groups = _two_by_two(rank)
        snapshots = []
        for state_device, accumulate, in_backward in ((None, "every", False), ("cpu", "every", False),
                                                      ("cpu", "no_sync", False), ("cpu", "no_sync", True)):
            model = _model()
            frozen = _frozen(model)
            frozen.requires_grad_(False)
            opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, bucket_cap_mb=1e-4,
                                                 state_device=state_device, host_step_in_backward=in_backward,
                                                 **groups)
            _train(model, opt, rank, world, range(STEPS), micro=2, accumulate=accumulate)
            opt.param_sync()
            snapshots.append(_snapshot(model, opt))
        if rank == 0:
            out.put(_differences(snapshots[1], snapshots[0], exact=True) +
                    [f"in backward: {p}" for p in _differences(snapshots[3], snapshots[2], exact=True)])
    _exit()


def test_forced_host_shards_with_a_redundant_group():
    assert _spawn(_redundant_worker, 4) == []


def test_state_device_on_cpu_params_is_a_no_op_placement(one_rank):
    model = _model()
    opt = shardadam.DistributedFusedAdam(model.parameters(), state_device="cpu")
    assert opt._host is None and opt.shard_state_device.type == "cpu"
    assert "state_device=cpu" in repr(opt)


def test_forced_host_shards_step_on_the_host_step_threads(one_rank, monkeypatch):
    """[Note: host step threads]: the host step's launches run on
    SHARDADAM_HOST_THREADS (or the host's cores shared among its ranks), not
    on torch's count, which torchrun sets to 1."""
    from shardadam import _plan
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)
    monkeypatch.setenv("SHARDADAM_HOST_THREADS", "3")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seen = []
    target = _plan.TensorPlan.target
    monkeypatch.setattr(_plan.TensorPlan, "target", lambda plan: seen.append(target(plan)[3]) or target(plan))
    try:
        model = _model()
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4, state_device="cpu")
        model(torch.randn(4, 3, 6, 6)).sum().backward()
        opt.grad_sync()
        seen.clear()
        opt.step()
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {3}, seen


def test_forced_host_shards_follow_a_layout_rebuild(one_rank, monkeypatch):
    """apex's late init_param_buffer() rebuilds the layout and carries the state
    over: with host shards too (new host rows, plans and streams), bit for bit."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)
    batches = [torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    results = []
    for state_device in (None, "cpu"):
        model = _model()
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4,
                                             state_device=state_device)
        for s, x in enumerate(batches):
            if s == 2:
                opt.init_param_buffer()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert (opt._host is not None) == (state_device == "cpu")
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_bad_host_threads_setting_is_refused(one_rank, monkeypatch):
    monkeypatch.setenv("SHARDADAM_HOST_THREADS", "many")
    with pytest.raises(ValueError, match="SHARDADAM_HOST_THREADS must be a positive integer"):
        shardadam.DistributedFusedAdam(_model().parameters(), state_device="cpu")


@pytest.mark.parametrize("kwargs,match", [
    (dict(state_device="cuda"), "state_device must be None .* or 'cpu'"),
    (dict(state_device="cpu", capturable=True), "capturable=True"),
])
def test_refusals(one_rank, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shardadam.DistributedFusedAdam(_model().parameters(), **kwargs)


@pytest.mark.cuda
def test_gpu_host_shards_match_gpu_state(tmp_path):
    """One rank on NCCL: the CUDA streams, page-locked rows and both checkpoint formats."""
    report = _spawn(_pair_worker, 1, list(CASES), "cuda", str(tmp_path))
    assert report == {case: [] for case in CASES}


# [Note: host step in backward]: the configurations it takes (no clipping, no
# GradScaler, accumulation in no_sync()).
IN_BACKWARD_CASES = ["fp32-no_sync", "contiguous-both-overlap", "bf16-master", "8-bit-amsgrad", "lion-8-bit",
                     "fp32-device-lr"]


def _in_backward_worker(rank: int, world: int, port: int, cases: list, device: str, out) -> None:
    """Each case trained with the host state stepped in step() and stepped
    during backward: the same kernels on the same values, so the same bits.
    Counts where the second run stepped its buckets: in step() (the main
    thread) in the first iteration, on the worker thread after it."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        if device == "cpu":
            _host_shards.runs_pipeline = lambda where: True  # this process only: force the pipeline
        on_worker = []
        step_bucket = _host_shards.HostShards._step_bucket

        def counted(self, *args):
            on_worker.append(threading.current_thread() is not threading.main_thread())
            return step_bucket(self, *args)

        _host_shards.HostShards._step_bucket = counted
        report = {}
        for case in cases:
            snapshots = []
            for in_backward in (False, True):
                on_worker.clear()
                model, opt = _build(case, "cpu", device, rank, host_step_in_backward=in_backward)
                _run(case, model, opt, rank, world, range(STEPS))
                snapshots.append(_snapshot(model, opt))
            problems = _differences(snapshots[1], snapshots[0], exact=True)
            # Every iteration steps every bucket that holds elements of this rank's shard.
            buckets = sum(plan is not None for plan in opt.plan)
            if on_worker != [False] * buckets + [True] * (STEPS - 1) * buckets:
                problems.append(f"the worker stepped {sum(on_worker)} buckets of {(STEPS - 1) * buckets}, "
                                f"{len(on_worker) - sum(on_worker)} elsewhere (expected {buckets})")
            report[case] = problems
        if rank == 0:
            out.put(report)
    _exit()


def test_host_step_in_backward_gives_the_same_bits():
    report = _spawn(_in_backward_worker, 2, IN_BACKWARD_CASES, "cpu")
    assert report == {case: [] for case in IN_BACKWARD_CASES}


@pytest.mark.cuda
def test_gpu_host_step_in_backward_gives_the_same_bits():
    """One rank on NCCL: the worker's copies up on their CUDA stream, under backward's kernels."""
    report = _spawn(_in_backward_worker, 1, IN_BACKWARD_CASES, "cuda")
    assert report == {case: [] for case in IN_BACKWARD_CASES}


def _in_backward(model, **options):
    return shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4, state_device="cpu",
                                          host_step_in_backward=True, **options)


def _backward(model, seed: int) -> None:
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _values(model, opt=None) -> list[torch.Tensor]:
    """The parameters, then (with opt) the host's states and parameter rows."""
    return [p.detach().clone() for p in model.parameters()] + \
        ([t.clone() for t in opt.states.values()] + [t.clone() for t in opt.param_shards.tensors] if opt else [])


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_host_step_in_backward_starts_before_step(one_rank, monkeypatch):
    """The first iteration steps in step() (it learns the backward order);
    from the second on, backward hands the buckets to the worker, and their
    states move before step() is called."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)
    model = _model()
    opt = _in_backward(model)
    _backward(model, 0)
    assert opt.iteration.host_step is None and not opt._host._futures
    opt.step()
    opt.zero_grad()
    before = _values(model, opt)
    _backward(model, 1)
    handed = list(opt._host._futures)
    assert opt.iteration.host_step and handed, "backward handed no bucket to the host step"
    for f in handed:
        f.result()
    params = len(list(model.parameters()))
    assert not _same(_values(model, opt)[params:], before[params:]), "no state moved in backward"
    assert _same(_values(model)[:params], before[:params]), "the model moved before step()"
    opt.step()
    assert opt.param_groups[0]["step"] == 2 and opt.iteration.host_step is None


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(state_device=None), ValueError, "needs state_device='cpu'"),
    (dict(overlap_grad_sync=False), ValueError, "needs overlap_grad_sync=True"),
    (dict(skip_nonfinite_grads=True), ValueError, "choose skip_nonfinite_grads or host_step_in_backward"),
    (dict(host_step_in_backward="yes"), TypeError, "host_step_in_backward must be True or False"),
])
def test_host_step_in_backward_refuses_options(one_rank, kwargs, error, match):
    options = dict(dict(state_device="cpu", host_step_in_backward=True), **kwargs)
    with pytest.raises(error, match=match):
        shardadam.DistributedFusedAdam(_model().parameters(), **options)


def _clip(model, opt):
    opt.clip_grad_norm(1.0)


def _scaled(model, opt):
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scaler's scale exists from here
    scaler.step(opt)


def _unscale(model, opt):
    opt.unscale_grads(inv_scale=0.5)


def _two_backwards(model, opt):
    _backward(model, 7)
    opt.step()


@pytest.mark.parametrize("misuse,match", [
    (_clip, "before clipping could know every gradient"),
    (_scaled, "before a GradScaler could know every gradient"),
    (_unscale, "before unscale_grads"),
    (_two_backwards, "several backward passes without no_sync"),
], ids=["clip", "grad-scaler", "unscale", "two-backwards"])
def test_host_step_in_backward_refuses_in_the_first_iteration_before_anything_moves(one_rank, monkeypatch, misuse,
                                                                                    match):
    """What needs every gradient before the step is refused in the first
    iteration, which steps in step(): nothing has moved yet."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)
    model = _model()
    opt = _in_backward(model)
    before = _values(model)
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=match):
        misuse(model, opt)
    assert _same(_values(model), before) and opt.param_groups[0]["step"] == 0


def _trained(steps: int, before=None, between=None) -> list[torch.Tensor]:
    """_values of a fresh model and in-backward optimizer after `steps`
    iterations; before(model, opt, s) runs before each backward,
    between(model, opt, s) between backward and step() (True: it stepped)."""
    model = _model()
    opt = _in_backward(model)
    for s in range(steps):
        if before is not None:
            before(model, opt, s)
        _backward(model, s)
        if between is None or not between(model, opt, s):
            opt.step()
        opt.zero_grad()
    return _values(model, opt)


@pytest.mark.parametrize("call", ["zero_grad", "state_dict", "sharded_state_dict", "init_params"])
def test_host_step_in_backward_refuses_a_half_stepped_state(one_rank, monkeypatch, call):
    """Between a backward that began stepping and step(), the state is part
    old, part new: reading, loading or dropping it is refused; step() then
    finishes the iteration as if nothing had been called."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)

    def refused(model, opt, s):
        if s == 2:
            with pytest.raises(RuntimeError, match=f"{call}.* between backward and step"):
                getattr(opt, call)()

    assert _same(_trained(3), _trained(3, between=refused))


def test_host_step_in_backward_reports_hyperparameters_changed_after_backward(one_rank, monkeypatch):
    """An lr set between backward and step() came too late for the host step:
    step() completes the step with the lr read at backward, then says so;
    the new lr applies from the next iteration."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)

    def in_time(model, opt, s):
        if s == 3:
            opt.param_groups[0]["lr"] = 5e-3

    def late(model, opt, s):
        if s != 2:
            return False
        opt.param_groups[0]["lr"] = 5e-3
        with pytest.raises(RuntimeError, match=r"lr \[0.01\] -> \[0.005\]"):
            opt.step()
        return True

    assert _same(_trained(4, before=in_time), _trained(4, between=late))


def test_host_step_in_backward_checks_hyperparameters_before_any_bucket_steps(one_rank, monkeypatch):
    """A bad learning rate set before a backward that would step the host is
    refused there, before any bucket moved; with a good one set again, the
    iteration steps as if nothing had happened."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)

    def bad_then_good(model, opt, s):
        if s == 2:
            opt.param_groups[0]["lr"] = -1.0
            before = _values(model, opt)
            with pytest.raises(ValueError, match="lr"):
                _backward(model, s)
            assert _same(_values(model, opt), before), "a bucket moved before the refusal"
            opt.param_groups[0]["lr"] = 1e-2
            opt.zero_grad()

    assert _same(_trained(3), _trained(3, before=bad_then_good))


def test_host_step_in_backward_reads_a_tensor_lr_once(one_rank, monkeypatch):
    """A tensor lr changed in place after backward read it: the step uses the
    value read, whole, and step() reports the change."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)

    def tensor_lr(model, opt, s):
        if s == 0:
            opt.param_groups[0]["lr"] = torch.tensor(1e-2)

    def late(model, opt, s):
        if s != 2:
            return False
        opt.param_groups[0]["lr"].fill_(5e-3)
        with pytest.raises(RuntimeError, match=r"lr \[0.01\] -> \[0.005\]"):
            opt.step()
        return True

    def in_time(model, opt, s):
        tensor_lr(model, opt, s)
        if s == 3:
            opt.param_groups[0]["lr"].fill_(5e-3)

    assert _same(_trained(4, before=in_time), _trained(4, before=tensor_lr, between=late))


def _after_a_first_iteration(monkeypatch):
    """A model and its in-backward optimizer (host pipeline forced) past the
    first iteration, which steps in step(): the next backward steps the host."""
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)
    model = _model()
    opt = _in_backward(model)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    return model, opt


def test_host_step_in_backward_raises_a_worker_error_in_step(one_rank, monkeypatch):
    """An error of the worker thread's step is not lost: step() raises it."""
    model, opt = _after_a_first_iteration(monkeypatch)
    launch = opt.rule.launch

    def failing(plan, hyper, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the host step failed")
        return launch(plan, hyper, **kwargs)

    monkeypatch.setattr(opt.rule, "launch", failing)
    _backward(model, 1)
    with pytest.raises(RuntimeError, match="the host step failed"):
        opt.step()


def test_host_step_in_backward_refuses_a_second_reduction_later(one_rank, monkeypatch):
    """After the first iteration, a second synchronised backward would
    reduce buckets the host already stepped: refused as it happens."""
    model, opt = _after_a_first_iteration(monkeypatch)
    _backward(model, 1)
    with pytest.raises(RuntimeError, match="several backward passes without no_sync"):
        _backward(model, 2)
        opt.step()
