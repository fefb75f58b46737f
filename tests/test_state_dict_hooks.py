"""torch.optim's state-dict hooks ([Note: state-dict hooks] in
_state_dict_hooks.py): registered on a shardadam optimizer, they run where
torch.optim.AdamW runs them, and what they return is what is saved and
loaded. On DistributedFusedAdam a load pre hook that raises on one rank is
raised on every rank, before anything is written."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardadam
from conftest import assert_bits_equal
from test_distributed import _exit, _rank_group, _spawn_all


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model, opt, seeds):
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        opt.zero_grad()
        model(torch.randn(5, 8, generator=g)).square().mean().backward()
        opt.step()


def _hooked(opt, calls: list):
    """The four hooks on opt: the saved dict gains a "saved_by" entry (post
    hook), which the load pre hook takes out again after checking it; the
    load pre hook also scales every lr, so that a load shows it used the dict
    the hook returned."""
    opt.register_state_dict_pre_hook(lambda o: calls.append("state_dict pre"))

    def post(o, state_dict):
        calls.append("state_dict post")
        return dict(state_dict, saved_by="hook")
    opt.register_state_dict_post_hook(post)

    def load_pre(o, state_dict):
        calls.append("load pre")
        assert state_dict.pop("saved_by") == "hook"  # a shallow copy: the caller's dict keeps it
        groups = [dict(g, lr=g["lr"] * 0.5) for g in state_dict["param_groups"]]
        return dict(state_dict, param_groups=groups)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))


def _save_and_load(opt):
    calls = []
    _hooked(opt, calls)
    saved = opt.state_dict()
    assert saved["saved_by"] == "hook"
    opt.load_state_dict(saved)
    assert saved["saved_by"] == "hook"  # the caller's dict is not modified
    return list(calls), opt.param_groups[0]["lr"]  # the calls so far: the hooks stay registered


@pytest.mark.parametrize("optimizer", ["FusedAdam", "FusedLion"])
def test_fused_optimizers_run_the_hooks_as_torch_does(optimizer):
    model, torch_model = _model(), _model()
    opt = getattr(shardadam, optimizer)(model.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    _train(model, opt, [1])
    _train(torch_model, reference, [1])
    assert _save_and_load(opt) == _save_and_load(reference) == (
        ["state_dict pre", "state_dict post", "load pre", "load post"], 5e-3)


def test_hooks_stay_out_of_copies():
    """A copy of the optimizer ([Note: copies of an optimizer]) carries the
    state without the original's hooks: it does not lose half the lr."""
    model = _model()
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2)
    _train(model, opt, [1])
    _hooked(opt, [])
    assert copy.deepcopy(opt).param_groups[0]["lr"] == 1e-2


def _distributed_worker(rank: int, world: int, port: int, out) -> None:
    with _rank_group(rank, world, port, out):
        model = _model()
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4)
        _train(model, opt, [1, 2])
        calls, lr = _save_and_load(opt)
        saved = opt.state_dict()
        before = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.states.values()]

        def fails_on_rank_1(o, state_dict):
            if rank == 1:
                raise ValueError("checkpoint from another run")
        opt.register_load_state_dict_pre_hook(fails_on_rank_1, prepend=True)
        try:
            opt.load_state_dict(saved)
            refusal = None
        except ValueError as e:
            refusal = str(e)
        after = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.states.values()]
        unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
        out.put((rank, dict(calls=calls, lr=lr, refusal=refusal, unchanged=unchanged)))
    _exit()


def test_distributed_optimizer_runs_the_hooks_and_agrees_on_a_refusing_one():
    results = _spawn_all(_distributed_worker, 2)
    for rank, result in enumerate(results):
        assert result["calls"] == ["state_dict pre", "state_dict post", "load pre", "load post"], rank
        assert result["lr"] == 5e-3, rank
        assert result["refusal"] is not None and "checkpoint from another run" in result["refusal"], rank
        assert result["unchanged"], f"rank {rank} wrote state before the refusal"
    assert results[0]["refusal"] == results[1]["refusal"]


def test_distributed_layout_rebuild_runs_no_hooks(monkeypatch):
    """The engine's own carry of state through a layout rebuild is not a
    user's save or load: no hook runs."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4)
        _train(model, opt, [1])
        calls = []
        _hooked(opt, calls)
        want = [p.detach().clone() for p in model.parameters()]
        opt._rebuild_layout(list(reversed(opt.params)), list(reversed(opt.param_groups_of)))
        assert calls == []
        for a, b in zip(want, model.parameters()):
            assert_bits_equal(a, b.detach())
        assert opt.param_groups[0]["lr"] == 1e-2
    finally:
        dist.destroy_process_group()
