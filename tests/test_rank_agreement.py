"""DistributedFusedAdam's ranks agree, on gloo with 2 processes:

- at construction, before rank 0's parameters are broadcast, every rank checks
  that all have the same parameters, groups and layout options (one
  fingerprint all-reduce): where they differ, every rank raises the same
  ValueError naming the first difference and the ranks, and no parameter is
  overwritten (today's code aborts gloo in the broadcast or trains on);
- a load (load_state_dict, load_sharded_state_dict) that only rank 1 refuses
  raises the same ValueError on both ranks, naming rank 1 and its reason, and
  nothing changes on either rank.

Every rank sends its result (_spawn_all collects them all); a rank that hangs
is stopped by _rank_group's timeout, so the test fails instead of hanging.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from test_distributed import _exit, _rank_group, _spawn_all
from test_load_refusals import assert_dist_unchanged, dist_snapshot


# ---------------------------------------------------------------- construction

SHAPES = [(4, 6), (4,), (3, 4), (3,)]


def _setup(case: str, rank: int):
    """(parameters, groups, options) of `case` on `rank`: rank 1 differs from rank 0 in one way."""
    shapes, frozen, split, kw = list(SHAPES), set(), 2, dict(bucket_cap_mb=1e-4, lr=1e-2)
    if rank == 1:
        if case == "shape":
            shapes[0] = (6, 4)
        elif case == "count":
            shapes.append((5,))
        elif case == "requires_grad":
            frozen = {3}
        elif case == "group-split":
            split = 1
        elif case == "bucket_cap_mb":
            kw["bucket_cap_mb"] = 100
        elif case == "dtype":
            pass  # below
        elif case == "lr":
            kw["lr"] = 2e-2
        elif case == "bad-bucket-cap":
            kw["bucket_cap_mb"] = -1
        elif case == "nan-lr":
            kw["lr"] = float("nan")
    torch.manual_seed(rank)  # other values on each rank: rank 0's are broadcast
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    if case == "dtype" and rank == 1:
        params[2] = nn.Parameter(params[2].detach().double())
    for i in frozen:
        params[i].requires_grad_(False)
    groups = [dict(params=params[:split]), dict(params=params[split:], weight_decay=0.0)]
    return params, groups, kw


def _construct_worker(rank: int, world: int, port: int, case: str, out) -> None:
    with _rank_group(rank, world, port, out):
        params, groups, kw = _setup(case, rank)
        before = [p.detach().clone() for p in params]
        try:
            opt = shardadam.DistributedFusedAdam(groups, overlap_grad_sync=False, **kw)
            message = None
        except (ValueError, TypeError, NotImplementedError) as e:
            opt, message = None, str(e)
        untouched = all(torch.equal(p.detach(), b) for p, b in zip(params, before))
        received = [p.detach().clone().numpy() for p in params] if opt is not None else None
        del opt
        out.put((rank, dict(message=message, untouched=untouched, params=received)))
    _exit()


CONSTRUCTION = {
    "shape": "param_groups[0]['params'][0]: shape: (4, 6) on rank 0, (6, 4) on rank 1",
    "count": "the number of parameters in param_groups[1]: 2 on rank 0, 3 on rank 1",
    "requires_grad": "param_groups[1]['params'][1]: requires_grad: True on rank 0, False on rank 1",
    "group-split": "the number of parameters in param_groups[0]: 2 on rank 0, 1 on rank 1",
    "bucket_cap_mb": "option bucket_cap_mb: 0.0001 on rank 0, 100 on rank 1",
    "dtype": "param_groups[1]['params'][0]: dtype: torch.float32 on rank 0, torch.float64 on rank 1",
    "lr": "param_groups[0]['lr']: 0.01 on rank 0, 0.02 on rank 1",
}


@pytest.mark.parametrize("case", list(CONSTRUCTION))
def test_ranks_with_different_setups_refuse_alike(case):
    results = _spawn_all(_construct_worker, 2, case)
    messages = [r["message"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], f"both ranks must raise the same error: {messages}"
    assert CONSTRUCTION[case] in messages[0], messages[0]
    assert "Every rank must build the same model and optimizer" in messages[0]
    assert all(r["untouched"] for r in results), "a parameter was overwritten before the refusal"


LOCAL = {
    "bad-bucket-cap": "rank 1: bucket_cap_mb must be > 0, got -1",
    "nan-lr": "rank 1: DistributedFusedAdam: lr must be finite, got nan",
}


@pytest.mark.parametrize("case", list(LOCAL))
def test_arguments_refused_on_one_rank_are_refused_on_every_rank(case):
    """A check one rank makes alone (its own arguments) must not leave the
    others waiting in the next collective: the verdicts are shared first."""
    results = _spawn_all(_construct_worker, 2, case)
    messages = [r["message"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], f"both ranks must raise the same error: {messages}"
    assert messages[0].startswith("DistributedFusedAdam(...) refused on rank 1 of 2 (no rank built the optimizer)")
    assert LOCAL[case] in messages[0], messages[0]


def test_ranks_with_the_same_setup_build_and_broadcast():
    """The control: the same setup builds, and rank 1 holds rank 0's values."""
    results = _spawn_all(_construct_worker, 2, "same")
    assert [r["message"] for r in results] == [None, None]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert (a == b).all()


# ---------------------------------------------------------------- loads


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model, opt, rank: int, world: int, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        F.mse_loss(model(x[part]), y[part]).backward()
        opt.step()


def _valid_but_different(sd: dict) -> dict:
    """A dict that loads, with every value other than the optimizer's: a write would show."""
    out = copy.deepcopy(sd)
    for g in out["param_groups"]:
        g["lr"], g["step"] = 0.5, 99
    for entry in out["state"].values():
        for k in entry:
            entry[k] = entry[k] * 2 + 1
    return out


def _break(sd: dict, case: str) -> dict:
    out = _valid_but_different(sd)
    if case == "shape":
        out["state"][0]["exp_avg"] = out["state"][0]["exp_avg"].reshape(-1)
    elif case == "lr-nan":
        out["param_groups"][1]["lr"] = math.nan
    elif case == "step-negative":
        out["param_groups"][0]["step"] = -3
    return out


def _break_sharded(sharded: dict, case: str) -> dict:
    out = dict(sharded)
    groups = json.loads(out["param_groups"])
    for g in groups:  # valid but different: a write would show in the groups
        g["lr"], g["step"] = 0.5, 99
    if case == "sharded-lr-inf":
        groups[0]["lr"] = math.inf
    elif case == "sharded-missing-state":
        out["state"] = {k: v for k, v in out["state"].items() if k != "exp_avg_sq"}
    elif case == "sharded-other-shapes":
        shapes = json.loads(out["shapes"])
        shapes[0][1] = shapes[0][1][::-1]
        out["shapes"] = json.dumps(shapes)
    out["param_groups"] = json.dumps(groups)
    return out


def _load_worker(rank: int, world: int, port: int, case: str, out) -> None:
    """Rank 1 gets a broken dict, rank 0 a valid one (with other values):
    both must refuse and change nothing; then a valid load and a step work."""
    with _rank_group(rank, world, port, out):
        model = _model()
        groups = [dict(params=[model[0].weight, model[2].weight]),
                  dict(params=[model[0].bias, model[2].bias], lr=3e-3, weight_decay=0.0)]
        opt = shardadam.DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                             overlap_grad_sync=False)
        _train(model, opt, rank, world, 2)
        sharded = case.startswith("sharded")
        good = opt.sharded_state_dict() if sharded else opt.state_dict()  # collectives: every rank
        if sharded:
            mine = _break_sharded(good, case if rank == 1 else "valid")
        else:
            mine = _break(good, case) if rank == 1 else _valid_but_different(good)
        before = dist_snapshot(opt, model)
        load = opt.load_sharded_state_dict if sharded else opt.load_state_dict
        try:
            load(mine)
            message = None
        except ValueError as e:
            message = str(e)
        try:
            assert_dist_unchanged(opt, model, before, f"rank {rank}")
            unchanged = None
        except AssertionError as e:
            unchanged = str(e)
        load(good)  # the ranks are still in step: a valid load and a step work
        _train(model, opt, rank, world, 1)
        del opt
        out.put((rank, dict(message=message, unchanged=unchanged)))
    _exit()


LOADS = {
    "shape": "state_dict['state'][0]['exp_avg'] has shape (96,)",
    "lr-nan": "state_dict['param_groups'][1]: lr must be finite, got nan",
    "step-negative": "state_dict['param_groups'][0]: step must be a whole number >= 0",
    "sharded-lr-inf": "sharded['param_groups'][0]: lr must be finite, got inf",
    "sharded-missing-state": "no state 'exp_avg_sq'",
    "sharded-other-shapes": "param_groups[0]['params'][0] (index 0) has shape (12, 8) in the checkpoint, (8, 12) in "
                            "the optimizer",
}


@pytest.mark.parametrize("case", list(LOADS))
def test_a_load_refused_on_one_rank_is_refused_on_every_rank(case):
    results = _spawn_all(_load_worker, 2, case)
    messages = [r["message"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], f"both ranks must raise the same error: {messages}"
    what = "load_sharded_state_dict" if case.startswith("sharded") else "load_state_dict"
    assert f"DistributedFusedAdam.{what} refused on rank 1 of 2 (nothing was loaded on any rank); rank 1: " \
        in messages[0], messages[0]
    assert LOADS[case] in messages[0], messages[0]
    for rank, r in enumerate(results):
        assert r["unchanged"] is None, f"rank {rank}: {r['unchanged']}"
