"""DistributedFusedMuon's overlap_param_sync, as the engine sees it: step()
returns with the Muon matrices' all-gathers in flight (the engine's pending
buckets), each module's forward waits for the buckets of its own parameters
before its body runs, zero_grad() leaves them running, and
sharded_state_dict() and state_dict() land them ([Note: Muon buckets between
iterations] in distributed/_muon_gather.py). Training with the option against
FusedMuon on the global batch, first-use reads included, is
test_distributed_muon's (its overlap-param-sync cases)."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from test_distributed import _exit, _rank_group, _spawn_all
from test_distributed_muon import GLOBAL_BATCH, OPTIONS, _data, _groups, _Net, _rank_model, _reference

HIDDEN = 1  # model.hidden.weight's index among the Muon parameters (_groups)


def _optimizer(model, **kw):
    return shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32, bucket_cap_mb=1e-3,
                                          overlap_param_sync=True, **OPTIONS, **kw)


def _iteration(model, opt, s, rank, world) -> None:
    """Forward, backward and step on this rank's slice of global batch s."""
    device = next(model.parameters()).device
    xs, ys = (t.to(device) for t in _data())
    per = GLOBAL_BATCH // world
    F.mse_loss(model(xs[s, rank * per:(rank + 1) * per]), ys[s, rank * per:(rank + 1) * per]).backward()
    opt.step()


def _deferred_worker(rank, world, port, device, out) -> None:
    with _rank_model(rank, world, port, dict(device=device), out) as model:
        opt = _optimizer(model)  # a bucket per parameter
        muon = opt._muon
        _iteration(model, opt, 0, rank, world)
        got = dict(after_step=sorted(muon.param_gathers.pending), adamw_after_step=bool(opt._adamw._param_sync.pending),
                   armed=[type(p) is not nn.Parameter for p in muon.params])
        opt.zero_grad()
        got["after_zero_grad"] = sorted(muon.param_gathers.pending)

        def before_body(module, args):  # registered after the optimizer's hook: runs after it
            got["hidden_pending_in_forward"] = muon.bucket_of[HIDDEN] in muon.param_gathers.pending
            got["hidden_armed_in_forward"] = type(module.weight) is not nn.Parameter

        handle = model.hidden.register_forward_pre_hook(before_body)
        x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2)).to(device)
        got["hidden_out"] = model.hidden(x).detach().cpu()
        handle.remove()
        got["after_hidden"] = sorted(muon.param_gathers.pending)
        got["hidden_bucket"] = muon.bucket_of[HIDDEN]
        got["owns_hidden"] = any(m.param == HIDDEN for m in muon.owned())
        opt.sharded_state_dict()
        got["after_sharded_state_dict"] = (sorted(muon.param_gathers.pending), bool(opt._adamw._param_sync.pending))
        _iteration(model, opt, 1, rank, world)
        opt.state_dict()
        got["after_state_dict"] = (sorted(muon.param_gathers.pending), bool(opt._adamw._param_sync.pending))
        got["params"] = [p.detach().cpu() for p in model.parameters()]
        out.put((rank, got))
    _exit()


@pytest.mark.parametrize("world,device", [
    (2, "cpu"),
    pytest.param(1, "cuda", marks=pytest.mark.cuda),
    pytest.param(2, "cuda", marks=pytest.mark.multigpu),
], ids=["gloo-2", "nccl-1", "nccl-2"])
def test_step_leaves_the_gathers_in_flight_and_each_forward_waits_for_its_own(world, device):
    """After step() every Muon bucket's all-gather is pending (and the AdamW
    part's), every Muon parameter armed; zero_grad() changes nothing; the
    forward-pre hook of model.hidden lands its bucket, and only it, before
    the module's body runs (a hook registered after the optimizer's sees it
    landed and disarmed), so its output is that of FusedMuon's parameters
    after the step, also where another rank owns the matrix."""
    results = _spawn_all(_deferred_worker, world, device)
    after_first = dict(zip([name for name, _ in _Net().named_parameters()], _reference(torch.float32, [0])))
    want_out = F.linear(torch.randn(5, 48, generator=torch.Generator().manual_seed(2)), after_first["hidden.weight"],
                        after_first["hidden.bias"])
    every = list(range(3))
    assert world == 1 or {r["owns_hidden"] for r in results} == {True, False}, "one rank must gather model.hidden"
    for r, got in enumerate(results):
        assert got["after_step"] == every and got["adamw_after_step"], f"rank {r}: step() waited for the all-gathers"
        assert all(got["armed"]), f"rank {r}: step() left a Muon parameter unguarded"
        assert got["after_zero_grad"] == every, f"rank {r}: zero_grad() waited for the all-gathers"
        assert not got["hidden_pending_in_forward"], f"rank {r}: model.hidden's body ran before its bucket landed"
        assert not got["hidden_armed_in_forward"], f"rank {r}: model.hidden's weight still armed in its forward"
        assert got["after_hidden"] == [b for b in every if b != got["hidden_bucket"]], \
            f"rank {r}: model.hidden's forward landed {got['after_hidden']}"
        torch.testing.assert_close(got["hidden_out"], want_out, rtol=1e-5, atol=2e-6,
                                   msg=lambda m: f"rank {r}, model.hidden's output after step 0: {m}")
        assert got["after_sharded_state_dict"] == ([], False), f"rank {r}: sharded_state_dict() left gathers in flight"
        assert got["after_state_dict"] == ([], False), f"rank {r}: state_dict() left gathers in flight"
        for i, (p, w) in enumerate(zip(got["params"], _reference(torch.float32, [0, 1]))):
            torch.testing.assert_close(p, w, rtol=1e-5, atol=2e-6, msg=lambda m: f"rank {r}, param {i}: {m}")


def test_a_dropped_optimizer_leaves_no_parameter_armed(one_rank):
    """The first-use guard and the forward hooks go with the optimizer: its
    parameters get their class back, and later forwards call nothing of it."""
    model = _Net()
    opt = _optimizer(model)
    _iteration(model, opt, 0, 0, 1)
    assert all(type(p) is not nn.Parameter for p in opt._muon.params)
    del opt
    gc.collect()
    assert all(type(p) is nn.Parameter for p in model.parameters())
    model(_data()[0][1])


def test_a_bucket_taking_gradients_lands_its_all_gather_first(one_rank):
    """A Muon bucket's buffers carry the gradients too ([Note: Muon buckets
    between iterations]): with the all-gathers of a step in flight and no
    forward to land them, a norm of no gradients is 0, and gradients set by
    hand have their own norm and step as FusedMuon steps them."""
    model, reference = _Net(), _Net()
    opt = _optimizer(model)
    ref = shardadam.FusedMuon(_groups(reference), ns_dtype=torch.float32, **OPTIONS)
    _iteration(model, opt, 0, 0, 1)
    assert opt._muon.param_gathers.pending
    assert float(opt.grad_norm()) == 0.0, "a bucket was reduced with its all-gather's values in it"
    opt.zero_grad()
    _iteration(reference, ref, 0, 0, 1)
    ref.zero_grad()
    for m, o in ((model, opt), (reference, ref)):
        _iteration(m, o, 1, 0, 1)
        o.zero_grad()
    assert opt._muon.param_gathers.pending, "the gradients set by hand must meet all-gathers in flight"
    generator = torch.Generator().manual_seed(3)
    by_hand = [torch.randn(p.shape, generator=generator) for p in model.parameters()]
    for m, o in ((model, opt), (reference, ref)):
        for p, g in zip(m.parameters(), by_hand):
            p.grad = g.clone()
    torch.testing.assert_close(opt.grad_norm(), torch.cat([g.flatten() for g in by_hand]).norm(), rtol=1e-5, atol=0)
    opt.step()
    ref.step()
    for i, (p, w) in enumerate(zip(model.parameters(), reference.parameters())):
        torch.testing.assert_close(p.detach(), w.detach(), rtol=1e-5, atol=2e-6, msg=lambda m: f"param {i}: {m}")


def _refusal_worker(rank, world, port, out) -> None:
    """2 ranks, the Muon groups alone (no inner DistributedFusedAdam to check
    its own copy of the option): overlap_param_sync not a bool on rank 1
    only, then True on rank 0 and False on rank 1; the messages, and whether
    the parameters (rank 1's differ from rank 0's, which the broadcast would
    write) are untouched."""
    with _rank_group(rank, world, port, out):
        model = _Net()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
        before = [p.detach().clone() for p in model.parameters()]
        messages = []
        for value in ("yes" if rank == 1 else True, rank == 0):
            try:
                shardadam.DistributedFusedMuon(_groups(model)[:1], overlap_param_sync=value, **OPTIONS)
                messages.append(None)
            except ValueError as e:
                messages.append(str(e))
        out.put((rank, dict(messages=messages,
                            unchanged=all(torch.equal(a, p) for a, p in zip(before, model.parameters())))))
    _exit()


def test_a_bad_or_disagreeing_overlap_param_sync_is_refused_on_every_rank_before_anything_is_written():
    results = _spawn_all(_refusal_worker, 2)
    not_bool, disagree = results[0]["messages"]
    assert not_bool is not None and "overlap_param_sync must be True or False, got 'yes': pass a bool" in not_bool
    assert disagree is not None and "option overlap_param_sync: True on rank 0, False on rank 1" in disagree
    for rank, result in enumerate(results):
        assert result["messages"] == [not_bool, disagree], f"rank {rank} raised otherwise: {result['messages']}"
        assert result["unchanged"], f"rank {rank}'s parameters were written"
