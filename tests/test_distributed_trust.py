"""DistributedFusedAdam when storage moves under it, when a step must be
refused, and when gradients are not finite (README "Guarantees").

One rank in the test process (gloo on the CPU, NCCL on one GPU) covers what
does not depend on the number of ranks; the agreement of several ranks on a
skipped step runs on 2 gloo processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import assert_bits_equal, randn
from shardadam import DistributedFusedAdam
from test_distributed import _exit, _rank_group, _spawn

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@pytest.fixture
def group(device):
    """One rank in this process: gloo for the CPU, NCCL for the GPU."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0) if device == "cuda" else None)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)


def _iteration(model, opt, device, seed, *, poison=None):
    """One forward, backward and step; poison(model) runs between backward and step."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(5, 8, generator=g).to(device, dtype), torch.randn(5, 4, generator=g).to(device)
    opt.zero_grad()
    nn.functional.mse_loss(model(x).float(), y).backward()
    if poison is not None:
        poison(model)
    opt.step()


def _stepped(device, **options):
    """A model and a DistributedFusedAdam over it that has taken one step."""
    model = _model(device)
    opt = DistributedFusedAdam(model.parameters(), **options)
    _iteration(model, opt, device, 1)
    return model, opt


def _stepped_with_twin(device, **options):
    """_stepped's model and optimizer, their snapshot, and a twin model that
    has taken the untouched second iteration (_iteration's seed 2)."""
    model, opt = _stepped(device, **options)
    want_model, want_opt = _stepped(device, **options)
    _iteration(want_model, want_opt, device, 2)
    return model, opt, _snapshot(opt, model), want_model


def _snapshot(opt, model):
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [t.clone() for t in (opt.states["exp_avg"], opt.states["exp_avg_sq"], opt.master) if t is not None]
    return tensors, [int(g["step"]) for g in opt.param_groups]


def _assert_unchanged(opt, model, snap, what):
    tensors, steps = _snapshot(opt, model)
    for i, (a, b) in enumerate(zip(tensors, snap[0])):
        assert_bits_equal(a, b, f"{what}: tensor {i}")
    assert steps == snap[1], f"{what}: step counters moved"


@pytest.mark.parametrize("option", ["contiguous_param_buffer", "contiguous_grad_buffer"])
@pytest.mark.parametrize("move", [lambda m: m.to(torch.bfloat16), lambda m: m.half().float(),
                                  lambda m: setattr(m[0].weight, "data", m[0].weight.data.clone())],
                         ids=["to-bf16", "half-float", "data-clone"])
def test_contiguous_buffers_refuse_a_moved_parameter(group, option, move):
    device = group
    model, opt = _stepped(device, overlap_grad_sync=False, **{option: True}, **HYPER)
    move(model)
    dtype = next(model.parameters()).dtype
    snap = _snapshot(opt, model)
    with pytest.raises(RuntimeError, match=rf"param_groups\[0\]\['params'\]\[\d\] \(shape \(.*\)\) no longer "
                                           rf"lives in the optimizer's memory.*{option}=True"):
        if option == "contiguous_grad_buffer":
            opt.zero_grad()
        else:
            _iteration(model, opt, device, 2)
    _assert_unchanged(opt, model, snap, "refused")
    assert dtype == next(model.parameters()).dtype


def test_a_parameter_given_new_memory_is_followed(group):
    """p.data = a copy (same values, other memory) changes nothing in the run:
    the same steps as an unmoved twin, bit for bit, and the old memory is left alone."""
    device = group
    model, twin = _model(device), _model(device)
    opt = DistributedFusedAdam(model.parameters(), **HYPER)
    topt = DistributedFusedAdam(twin.parameters(), **HYPER)
    for seed in (1, 2):
        _iteration(model, opt, device, seed)
        _iteration(twin, topt, device, seed)
    old = model[2].weight.data
    old_bits = old.clone()
    model[2].weight.data = old.clone()
    for seed in (3, 4):
        _iteration(model, opt, device, seed)
        _iteration(twin, topt, device, seed)
    assert_bits_equal(old, old_bits, "the memory the parameter left was written")
    for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
        assert_bits_equal(p, q, f"param[{i}]")


def test_a_parameter_of_another_shape_is_refused(group):
    device = group
    model, opt = _stepped(device, overlap_grad_sync=False, **HYPER)
    snap = _snapshot(opt, model)
    model[2].weight.data = randn((64,), device=device)
    model[2].weight.grad = None
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\] \(shape \(4, 16\)\) changed shape to \(64,\)"):
        opt.step()
    model[2].weight.data = snap[0][2].clone()
    _assert_unchanged(opt, model, snap, "refused")


def test_replaced_parameter_objects_are_refused(group):
    device = group
    model, opt = _stepped(device, **HYPER)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"replaced Linear.weight \(shape \(16, 8\)\) by a new Parameter"):
        _iteration(model, opt, device, 2)


def test_a_gradient_of_another_size_is_refused(group):
    device = group
    model, opt = _stepped(device, overlap_grad_sync=False, **HYPER)
    snap = _snapshot(opt, model)

    def poison(m):
        m[0].bias.grad.data = torch.zeros(3, device=device)

    with pytest.raises(ValueError, match=r"shape \(16,\) has 3 elements"):
        _iteration(model, opt, device, 2, poison=poison)
    _assert_unchanged(opt, model, snap, "refused")


def _poison_last_weight(m):
    m[2].weight.grad = torch.zeros_like(m[2].weight)


@pytest.mark.parametrize("contiguous", [False, True], ids=["buckets", "contiguous-grad-buffer"])
def test_a_gradient_set_after_the_hand_over_is_refused(group, contiguous):
    """[Note: gradients set after the hand-over]: backward handed each
    gradient over as it came (from the second iteration, once the order is
    learnt), so a gradient assigned afterwards would be dropped silently.
    step() refuses it before writing anything, and once it is set back steps
    with backward's gradients, as an iteration without it does."""
    device = group
    model, opt, snap, want_model = _stepped_with_twin(device, **HYPER, contiguous_grad_buffer=contiguous)
    left = r"optimizer\.grad_buffer_view\(p\)" if contiguous else "None"
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\]: its gradient was set after "
                                           r"backward handed it over .*overlap_grad_sync=False; to step with what "
                                           rf"backward produced, set p\.grad back to {left}"):
        _iteration(model, opt, device, 2, poison=_poison_last_weight)
    _assert_unchanged(opt, model, snap, "refused")
    model[2].weight.grad = opt.grad_buffer_view(model[2].weight) if contiguous else None
    opt.step()
    for i, (got, want) in enumerate(zip(model.parameters(), want_model.parameters())):
        assert_bits_equal(got, want, f"parameter {i} after the step with backward's gradients")


def test_a_gradient_set_after_grad_norm_synchronised_is_refused(group):
    """[Note: gradients set after the hand-over]: once grad_norm() has
    synchronised the gradients, step() does not synchronise again, so it
    looks for a gradient set since then itself, before writing anything."""
    device = group
    model, opt, snap, want_model = _stepped_with_twin(device, **HYPER)

    def poison(m):
        opt.grad_norm()
        _poison_last_weight(m)

    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\]: its gradient was set after "
                                           r"backward handed it over"):
        _iteration(model, opt, device, 2, poison=poison)
    _assert_unchanged(opt, model, snap, "refused")
    model[2].weight.grad = None
    opt.step()
    for i, (got, want) in enumerate(zip(model.parameters(), want_model.parameters())):
        assert_bits_equal(got, want, f"parameter {i} after the step with backward's gradients")


@pytest.mark.parametrize("change", ["clip_grad_norm_", "zero_grad(set_to_none=False)",
                                    "clip_grad_norm_ after grad_norm()"])
def test_an_in_place_change_of_a_buffer_gradient_after_the_hand_over_is_refused(group, change):
    """[Note: gradients set after the hand-over]: with the contiguous gradient
    buffer p.grad stays the parameter's view of it, so an in-place change
    after backward handed it over (torch.nn.utils.clip_grad_norm_, zeroing)
    would reach part of the step or none of it. step() refuses it before
    writing anything, also when grad_norm() synchronised the gradients
    before the change; zero_grad() and a new backward then step as an
    iteration without the change does."""
    device = group
    model, opt, snap, want_model = _stepped_with_twin(device, **HYPER, contiguous_grad_buffer=True)

    def poison(m):
        if change.endswith("after grad_norm()"):
            opt.grad_norm()
        if change.startswith("zero_grad"):
            m.zero_grad(set_to_none=False)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)

    with pytest.raises(RuntimeError, match=r"DistributedFusedAdam: the contiguous gradient buffer was written in "
                                           r"place after backward handed the gradients over .*so this step would "
                                           r"not see the change .*Clip with optimizer\.clip_grad_norm\(\)"):
        _iteration(model, opt, device, 2, poison=poison)
    _assert_unchanged(opt, model, snap, "refused")
    _iteration(model, opt, device, 2)
    for i, (got, want) in enumerate(zip(model.parameters(), want_model.parameters())):
        assert_bits_equal(got, want, f"parameter {i} after a new backward")


@pytest.mark.parametrize("change", ["assigned", "in place"])
def test_a_gradient_changed_after_a_host_step_in_backward_is_reported(group, monkeypatch, change):
    """With host_step_in_backward the buckets are stepped during backward:
    step() finishes that step and then reports the change. An assigned
    gradient was not used (the step equals an iteration without it, bit for
    bit); a change in place of the contiguous gradient buffer raced with the
    copies of the reduced shards to the host (on the GPU part of it reaches
    the step, on the CPU none), and the report says so."""
    from shardadam.distributed import _host_shards
    monkeypatch.setattr(_host_shards, "runs_pipeline", lambda where: True)  # the host pipeline on the CPU too
    device = group
    model, opt, _, want_model = _stepped_with_twin(device, **HYPER, state_device="cpu", host_step_in_backward=True,
                                                   contiguous_grad_buffer=change == "in place")
    what = (r"with the gradients backward produced: the gradient of param_groups\[0\]\['params'\]\[2\] was set "
            r"after backward handed it over, and was not used" if change == "assigned" else
            r"during backward: the contiguous gradient buffer was written in place after backward handed the "
            r"gradients over .* while the host step was copying them down, so part of the change may have reached "
            r"this step")
    with pytest.raises(RuntimeError, match=r"stepped this iteration " + what):
        _iteration(model, opt, device, 2, poison=_poison_last_weight if change == "assigned"
                   else lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3))
    if change == "in place":
        return
    for i, (got, want) in enumerate(zip(model.parameters(), want_model.parameters())):
        assert_bits_equal(got, want, f"parameter {i} after the host step")


@pytest.mark.parametrize("unfreeze", [False, True], ids=["frozen-later", "unfrozen-later"])
def test_a_change_of_requires_grad_after_building_is_refused(group, unfreeze):
    """[Note: the trainable set]: the layout shards the parameters that
    required a gradient when it was built. Frozen later, a parameter would go
    on taking steps with zero gradients; unfrozen later, its gradients would
    be ignored. step() refuses both before writing anything, and steps again
    once requires_grad is back as it was."""
    device = group
    model = _model(device)
    model[0].bias.requires_grad_(not unfreeze)
    opt = DistributedFusedAdam(model.parameters(), **HYPER)
    _iteration(model, opt, device, 1)
    snap = _snapshot(opt, model)
    model[0].bias.requires_grad_(unfreeze)
    match = (r"when the optimizer was built and requires a gradient now: it has no shard, so its gradients would "
             r"be ignored" if unfreeze else r"after the optimizer was built: its shard would go on taking steps "
             r"with zero gradients")
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\] was frozen \(requires_grad=False\) "
                                           + match + r".*build a new one after changing it"):
        _iteration(model, opt, device, 2)
    _assert_unchanged(opt, model, snap, "refused")
    model[0].bias.requires_grad_(not unfreeze)
    _iteration(model, opt, device, 3)
    assert [int(g["step"]) for g in opt.param_groups] == [2]


def test_a_group_added_after_building_is_refused(group):
    """[Note: the trainable set]: a group added by add_param_group after
    construction would have no shards (never trained; the next step failed
    on its missing step counter). It is refused, nothing is added, and
    training goes on as before."""
    device = group
    model, opt, snap, want_model = _stepped_with_twin(device, **HYPER)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"DistributedFusedAdam\.add_param_group: the optimizer shards the "
                                         r"parameters it was built with, so a group added now would never be "
                                         r"trained"):
        opt.add_param_group({"params": list(nn.Linear(3, 3).to(device).parameters()), "lr": 0.1})
    assert [dict(g) for g in opt.param_groups] == groups
    _assert_unchanged(opt, model, snap, "refused")
    _iteration(model, opt, device, 2)
    for i, (got, want) in enumerate(zip(model.parameters(), want_model.parameters())):
        assert_bits_equal(got, want, f"parameter {i}")


def test_a_newer_optimizer_over_the_same_parameters_takes_their_gradients(group):
    """[Note: the newest optimizer takes the gradients]: an optimizer still
    alive (an LR scheduler or a trainer may hold it) whose hooks took each
    gradient first left a new one over the same parameters None gradients.
    Now the new one trains as one built alone does, bit for bit, and the old
    one refuses to step, before writing anything."""
    device = group
    model, old = _stepped(device, **HYPER)
    alone = _model(device)
    alone.load_state_dict(model.state_dict())
    new = DistributedFusedAdam(model.parameters(), **HYPER)
    want = DistributedFusedAdam(alone.parameters(), **HYPER)
    for seed in (2, 3, 4):
        _iteration(model, new, device, seed)
        _iteration(alone, want, device, seed)
    for i, (got, expected) in enumerate(zip(model.parameters(), alone.parameters())):
        assert_bits_equal(got, expected, f"parameter {i}")
    snap = _snapshot(old, model)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[\d\] \(and maybe more\) belongs to a "
                                           r"newer DistributedFusedAdam built over it since, which now takes its "
                                           r"gradients: step that one"):
        old.step()
    _assert_unchanged(old, model, snap, "refused")


@pytest.mark.parametrize("change, error", [
    ({"lr": float("nan")}, ValueError), ({"lr": "1e-3"}, TypeError), ({"betas": (0.9, 1.5)}, ValueError),
    ({"eps": float("-inf")}, ValueError), ({"weight_decay": float("inf")}, ValueError),
])
def test_invalid_hyperparameters_refuse_the_step(group, change, error):
    device = group
    model = _model(device)
    params = list(model.parameters())
    opt = DistributedFusedAdam([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], **HYPER)
    _iteration(model, opt, device, 1)
    opt.param_groups[1].update(change)
    snap = _snapshot(opt, model)
    with pytest.raises(error, match=rf"param_groups\[1\]: {next(iter(change))}"):
        _iteration(model, opt, device, 2)
    _assert_unchanged(opt, model, snap, "refused")


def test_step_bumps_the_version_of_saved_parameters(group):
    device = group
    model, opt = _stepped(device, **HYPER)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    loss = model(x).sum()  # saves the weights for the gradient of x
    _iteration(model, opt, device, 2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_nonfinite_gradients_skip_the_step_when_asked(group):
    device = group
    model, opt = _stepped(device, overlap_grad_sync=False, skip_nonfinite_grads=True, **HYPER)
    snap = _snapshot(opt, model)

    def poison(m):
        m[2].weight.grad[1, 3] = float("nan")

    _iteration(model, opt, device, 2, poison=poison)
    _assert_unchanged(opt, model, snap, "skipped step")
    assert opt.skipped_steps == 1
    _iteration(model, opt, device, 3)
    assert int(opt.param_groups[0]["step"]) == 2, "a finite step after the skip is taken"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _skip_worker(rank: int, world: int, port: int, out) -> None:
    """Rank 1's first layer gets an inf gradient in iteration 2 (through a
    tensor hook: with overlap_grad_sync the gradient is handed over inside
    backward); rank 0 reports what every rank saw."""
    with _rank_group(rank, world, port, out):
        model = _model("cpu")
        opt = DistributedFusedAdam(model.parameters(), skip_nonfinite_grads=True, bucket_cap_mb=1e-4, **HYPER)
        _iteration(model, opt, "cpu", 1)
        before = [p.detach().clone() for p in model.parameters()]
        if rank == 1:
            model[0].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
        _iteration(model, opt, "cpu", 2)
        mine = (rank, opt.skipped_steps, int(opt.param_groups[0]["step"]),
                all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            out.put(everyone)
    _exit()


def test_nonfinite_gradients_on_one_rank_skip_the_step_on_every_rank():
    assert _spawn(_skip_worker, 2) == [(0, 1, 1, True), (1, 1, 1, True)]


def _alone_worker(rank: int, world: int, port: int, out) -> None:
    """Rank 0 alone asks for the gradient norm (a collective) before the step."""
    with _rank_group(rank, world, port, out):
        model = _model("cpu")
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=1e-4, **HYPER)
        _iteration(model, opt, "cpu", 1)
        error = None
        try:
            _iteration(model, opt, "cpu", 2, poison=(lambda m: opt.grad_norm()) if rank == 0 else None)
        except RuntimeError as e:
            error = str(e)
        everyone = [None] * world
        dist.all_gather_object(everyone, error)
        if rank == 0:
            out.put(everyone)
    _exit()


def test_a_rank_calling_a_collective_alone_raises_on_every_rank_under_distributed_debug(monkeypatch):
    """README: grad_norm() is a collective; with TORCH_DISTRIBUTED_DEBUG=DETAIL
    every collective carries a sequence number and fingerprint, so the rank
    that called it alone and its peers raise instead of waiting forever."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the ranks read it when they start
    errors = _spawn(_alone_worker, 2)
    assert all(e is not None and "Detected mismatch between collectives" in e for e in errors), errors
    assert "OpType=ALLREDUCE" in errors[0], errors[0]
