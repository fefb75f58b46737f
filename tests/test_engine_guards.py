"""The engine's guards, each alone: the superseded optimizer, the trainable
set and moved storage on plain tensors (no process group), the hand-over
guard on a one-rank optimizer in this process. The spawned runs of
test_distributed_trust.py and test_storage_moves.py cover them inside
whole iterations."""
from __future__ import annotations

import gc

import pytest
import torch

import shardadam
from shardadam._addresses import pointers
from shardadam.distributed._guard_hand_over import HandOverGuard
from shardadam.distributed._guard_storage import StorageGuard
from shardadam.distributed._guard_superseded import SupersededGuard
from shardadam.distributed._guard_trainable import TrainableSetGuard
from shardadam.distributed._iteration import Grads


def _params(*shapes) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def _names(params) -> dict:
    return {id(p): f"param_groups[0]['params'][{i}]" for i, p in enumerate(params)}


# ---------------------------------------------------------------- superseded optimizers

def test_newer_guard_takes_the_parameters_and_names_the_first_shared_one():
    a, b, c = _params(2, 3, 4)
    older, newer = SupersededGuard("Opt"), SupersededGuard("Opt")
    older.take([a, b], _names([a, b]))
    older.check()  # the newest over its parameters
    newer.take([c, b], {id(c): "c", id(b): "b"})
    assert older.taken_by == "b" and newer.taken_by is None
    with pytest.raises(RuntimeError, match=r"^b \(and maybe more\) belongs to a newer Opt built over it since"):
        older.check()
    newer.check()


def test_taking_the_same_parameters_again_does_not_mark_oneself():
    params = _params(2, 3)
    guard = SupersededGuard("Opt")
    guard.take(params, _names(params))
    guard.take(params, _names(params))  # a layout rebuild
    assert guard.taken_by is None


def test_the_first_taken_parameter_stays_named():
    a, b = _params(2, 3)
    older = SupersededGuard("Opt")
    older.take([a, b], _names([a, b]))
    SupersededGuard("Opt").take([a], {id(a): "a"})
    SupersededGuard("Opt").take([b], {id(b): "b"})
    assert older.taken_by == "a"


def test_a_freed_older_guard_is_not_reached():
    a, = _params(2)
    older = SupersededGuard("Opt")
    older.take([a], {id(a): "a"})
    del older
    gc.collect()
    newer = SupersededGuard("Opt")
    newer.take([a], {id(a): "a"})  # the old entry's weak reference is dead: nothing to mark
    assert newer.taken_by is None


# ---------------------------------------------------------------- the trainable set

def test_trainable_set_unchanged_passes():
    params = _params(2, 3)
    params[1].requires_grad_(False)
    groups = [{"params": params}]
    guard = TrainableSetGuard("Opt")
    guard.track(groups)
    guard.check(groups)


@pytest.mark.parametrize("flip", [0, 1])
def test_trainable_set_change_is_refused_naming_the_parameter(flip):
    params = _params(2, 3, 4)
    params[1].requires_grad_(False)
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    guard = TrainableSetGuard("Opt")
    guard.track(groups)
    if flip == 0:
        params[2].requires_grad_(False)
        expected = r"^param_groups\[1\]\['params'\]\[1\] was frozen \(requires_grad=False\) after the optimizer"
    else:
        params[1].requires_grad_(True)
        expected = r"^param_groups\[1\]\['params'\]\[0\] was frozen \(requires_grad=False\) when the optimizer was"
    with pytest.raises(RuntimeError, match=expected):
        guard.check(groups)


def test_new_group_refused_once_tracked_only():
    guard = TrainableSetGuard("Opt")
    guard.refuse_new_group()  # while the constructor gathers the groups
    guard.track([{"params": _params(2)}])
    with pytest.raises(ValueError, match=r"^Opt.add_param_group: the optimizer shards the parameters it was built"):
        guard.refuse_new_group()


# ---------------------------------------------------------------- moved storage

def _storage_check(guard, params, **buffers):
    kw = dict(contiguous_param_buffer=False, contiguous_grad_buffer=False) | buffers
    guard.check(params, [{"params": params}], **kw)


def test_moved_storage_is_followed_without_contiguous_buffers():
    params = _params(2, 3)
    guard = StorageGuard("Opt")
    guard.track(params)
    params[1].data = torch.randn(3)
    _storage_check(guard, params)
    assert pointers(guard.ptrs) == [p.data_ptr() for p in params]


@pytest.mark.parametrize("option", ["contiguous_param_buffer", "contiguous_grad_buffer"])
def test_moved_storage_is_refused_with_a_contiguous_buffer(option):
    params = _params(2, 3)
    guard = StorageGuard("Opt")
    guard.track(params)
    before = pointers(guard.ptrs)
    params[1].data = torch.randn(3)
    with pytest.raises(RuntimeError, match=rf"^param_groups\[0\]\['params'\]\[1\] \(shape \(3,\)\) no longer lives "
                                           rf".* after Opt\({option}=True\)"):
        _storage_check(guard, params, **{option: True})
    assert pointers(guard.ptrs) == before  # refused: nothing followed


def test_changed_shape_is_refused_and_the_first_in_group_order_named():
    params = _params(2, 3, 4)
    guard = StorageGuard("Opt")
    guard.track(params[::-1])  # the layout's order: not param_groups'
    params[2].data = torch.randn(5)
    params[0].data = torch.randn(6)
    with pytest.raises(ValueError, match=r"^param_groups\[0\]\['params'\]\[0\] \(shape \(2,\)\) changed shape to "
                                         r"\(6,\)"):
        guard.check(params[::-1], [{"params": params}], contiguous_param_buffer=False,
                    contiguous_grad_buffer=False)


# ---------------------------------------------------------------- gradients after the hand-over

def _handed_over(contiguous_grad_buffer: bool):
    """A one-rank optimizer whose backward order is known (one step done)
    and whose second backward handed every gradient over."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, contiguous_grad_buffer=contiguous_grad_buffer)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        if _ == 0:
            opt.step()
    return model, opt


@pytest.mark.parametrize("contiguous_grad_buffer", [False, True])
def test_hand_over_guard_passes_what_backward_left(one_rank, contiguous_grad_buffer):
    _, opt = _handed_over(contiguous_grad_buffer)
    guard = opt._hand_over_guard
    assert guard.late_gradients(opt) == "" and not guard.buffer_written(opt)
    guard.refuse(opt)
    assert guard.host_step_report(opt) == ""


@pytest.mark.parametrize("contiguous_grad_buffer", [False, True])
def test_hand_over_guard_names_gradients_set_late(one_rank, contiguous_grad_buffer):
    model, opt = _handed_over(contiguous_grad_buffer)
    params = list(model.parameters())
    params[1].grad = torch.ones(3)
    params[3].grad = torch.ones(2)
    guard = opt._hand_over_guard
    # the first in the layout's order (backward's: the last layer first) is named
    assert guard.late_gradients(opt) == "param_groups[0]['params'][3] (and 1 more)"
    left = "optimizer.grad_buffer_view\\(p\\)" if contiguous_grad_buffer else "None"
    with pytest.raises(RuntimeError, match=rf"^param_groups\[0\]\['params'\]\[3\] \(and 1 more\): its gradient was set "
                                           rf"after backward handed it over .* set p.grad back to {left}$"):
        guard.refuse(opt)
    assert "the gradient of param_groups[0]['params'][3] (and 1 more) was set after" in guard.host_step_report(opt)


def test_hand_over_guard_sees_the_buffer_written_in_place(one_rank):
    model, opt = _handed_over(contiguous_grad_buffer=True)
    guard = opt._hand_over_guard
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert guard.late_gradients(opt) == "" and guard.buffer_written(opt)
    with pytest.raises(RuntimeError, match=r"^DistributedFusedAdam: the contiguous gradient buffer was written in "
                                           r"place after backward handed the gradients over"):
        guard.refuse(opt)
    guard.record(opt)  # a synchronisation's own writes
    assert not guard.buffer_written(opt)


def test_hand_over_guard_refuses_a_gradient_added_into_the_consumed_buffer(one_rank):
    model = torch.nn.Linear(4, 3)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, contiguous_grad_buffer=True)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    assert opt.iteration.grads is Grads.CONSUMED
    for p in model.parameters():  # gradients that replaced their views are taken
        p.grad = torch.zeros_like(p)
    HandOverGuard.refuse_added_into_consumed(opt, range(2))
    model.bias.grad = opt.grad_buffer_view(model.bias)  # as autograd accumulating into the view leaves it
    with pytest.raises(RuntimeError, match=r"^param_groups\[0\]\['params'\]\[1\]: a gradient was added into the "
                                           r"contiguous gradient buffer while it still holds"):
        HandOverGuard.refuse_added_into_consumed(opt, range(2))
