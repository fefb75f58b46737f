"""The ZeRO engine's iteration state ([Note: iteration phases] in
distributed/_iteration.py): legal and refused moves, the one-shot
backward-order probe, and, on one in-process gloo rank, what a user sees when
calls come out of order."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from shardadam.distributed._iteration import BackwardOrderProbe, Grads, Iteration, Params


def test_gradients_move_accumulating_reducing_reduced_and_back():
    it = Iteration()
    for to in (Grads.REDUCING, Grads.REDUCING, Grads.REDUCED, Grads.REDUCED):
        it.move_grads(to)
        assert it.grads is to
    it.clip, it.inv_scale = (1.0, torch.ones(())), torch.ones(())
    it.end()
    assert (it.grads, it.clip, it.inv_scale) == (Grads.ACCUMULATING, None, None)


def test_a_reduction_after_the_gradients_were_reduced_is_refused():
    it = Iteration(grads=Grads.REDUCED)
    with pytest.raises(RuntimeError, match="a backward after the gradients were reduced.*step\\(\\)"):
        it.move_grads(Grads.REDUCING)
    assert it.grads is Grads.REDUCED, "a refused move changes nothing"


@pytest.mark.parametrize("start,to,legal", [
    (Params.CURRENT, Params.GATHERING, True),
    (Params.CURRENT, Params.DEFERRED, True),
    (Params.GATHERING, Params.CURRENT, True),
    (Params.DEFERRED, Params.GATHERING, True),
    (Params.DEFERRED, Params.DEFERRED, True),
    (Params.GATHERING, Params.DEFERRED, False),  # a deferred all-gather never overtakes a running one
    (Params.DEFERRED, Params.CURRENT, False),    # deferred all-gathers must run before parameters are current
])
def test_parameter_moves(start, to, legal):
    it = Iteration(params=start)
    if legal:
        it.move_params(to)
        assert it.params is to
    else:
        with pytest.raises(RuntimeError, match=f"{start.value} -> {to.value}"):
            it.move_params(to)
        assert it.params is start


def test_the_backward_order_probe_is_one_shot():
    probe = BackwardOrderProbe(active=True)
    for k in (3, 1, 3, 0):  # a parameter used twice counts where it first arrived
        probe.record(k)
    assert probe.take(5) == [3, 1, 0, 2, 4], "then the parameters that never arrived, in order"
    assert not probe.active and probe.arrivals == []


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4,
                                         overlap_param_sync=True)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    return model, opt, lambda: F.mse_loss(model(x), y).backward()


def test_phases_through_training_iterations(one_rank):
    model, opt, backward = _setup()
    assert (opt.iteration.grads, opt.iteration.params) == (Grads.ACCUMULATING, Params.CURRENT)
    backward()  # the first backward teaches the layout its order: nothing is reduced yet
    assert opt.iteration.grads is Grads.ACCUMULATING
    opt.clip_grad_norm(1.0)
    assert opt.iteration.grads is Grads.REDUCED and opt.iteration.clip is not None
    opt.step()
    assert opt.iteration.grads is Grads.ACCUMULATING and opt.iteration.clip is None
    assert opt.iteration.params is Params.GATHERING, "overlap_param_sync: the next forward waits"
    backward()  # forward waited for every bucket; backward hands gradients over
    assert opt.iteration.params is Params.CURRENT
    assert opt.iteration.grads is Grads.REDUCING
    opt.step()
    opt.param_sync()
    assert opt.iteration.params is Params.CURRENT


def test_a_backward_between_clipping_and_step_is_refused(one_rank):
    model, opt, backward = _setup()
    backward()
    opt.step()  # past the backward-order probe
    opt.zero_grad()
    backward()
    opt.clip_grad_norm(1.0)
    with pytest.raises(RuntimeError, match="a backward after the gradients were reduced"):
        backward()
    opt.zero_grad()  # an abandoned iteration starts over
    backward()
    opt.step()
    assert opt.iteration.grads is Grads.ACCUMULATING


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_param_sync", "no-overlap"])
def test_param_sync_before_the_first_step_leaves_the_parameters(one_rank, overlap):
    """Before the first step the shards hold no values yet (the state starts
    from the parameters at that step): param_sync() (a framework's teardown,
    a save before training) must not all-gather them over the parameters."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt = shardadam.DistributedFusedAdam(model.parameters(), overlap_param_sync=overlap)
    opt.param_sync()
    for i, (p, b) in enumerate(zip(model.parameters(), before)):
        assert torch.equal(p, b), f"param {i} changed"
