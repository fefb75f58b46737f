"""DistributedFusedMuon's DCP checkpoints ([Note: Muon momentum in DCP] in
distributed/_muon_dcp.py) on gloo ranks: saved on 2 ranks, each writing only
the matrices it owns and its shards of the AdamW groups, then loaded on 1, 2
and 3 ranks, where the matrices have other owners.

The model is test_distributed_muon's (a tall and a wide Muon matrix, a 3-D
expert parameter, an AdamW group). The loading run first takes a step of its
own, so its momentum, Adam states and parameters differ from the
checkpoint's: whatever the load leaves out shows in the loaded state, which
must equal the saved one exactly, and in the continued run, which must equal
FusedMuon's uninterrupted one on the global batch (fp32 rounding apart) and,
on the saving world size, the uninterrupted distributed run bit for bit.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardadam
from shardadam.distributed._muon_owners import plan_owner_buckets
from test_distributed import _exit, _numpy, _rank_group, _spawn_all
from test_distributed_muon import OPTIONS, STEPS, _groups, _Net, _reference, _train

SAVE_WORLD, SAVED_STEPS = 2, 2


def _optimizer(model, momentum_dtype=None):
    return shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32, momentum_dtype=momentum_dtype,
                                          **OPTIONS)


def _params(model) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def _save_worker(rank, world, port, path, momentum_dtype, out) -> None:
    """SAVED_STEPS steps, dcp.save, then the rest of the run uninterrupted."""
    with _rank_group(rank, world, port, out):
        model = _Net()
        opt = _optimizer(model, momentum_dtype)
        _train(model, opt, range(SAVED_STEPS), rank, world)
        dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
        state = _numpy(opt.state_dict())
        _train(model, opt, range(SAVED_STEPS, STEPS), rank, world)
        out.put((rank, dict(state=state, params=_params(model))))
    _exit()


def _load_worker(rank, world, port, path, momentum_dtype, out) -> None:
    """A step of its own, then check, dcp.load and load the checkpoint and
    take the steps after it."""
    with _rank_group(rank, world, port, out):
        model = _Net()
        opt = _optimizer(model, momentum_dtype)
        _train(model, opt, range(STEPS - 1, STEPS), rank, world)  # state the checkpoint must replace
        opt.check_sharded_checkpoint(path)
        state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_sharded_state_dict(state["optim"])
        loaded = _numpy(opt.state_dict())
        _train(model, opt, range(SAVED_STEPS, STEPS), rank, world)
        out.put((rank, dict(state=loaded, params=_params(model), owned=opt.orthogonalized_matrices())))
    _exit()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints of 2 ranks, by momentum_dtype: (path, rank 0's result)."""
    cache = {}

    def save(momentum_dtype):
        if momentum_dtype not in cache:
            path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
            cache[momentum_dtype] = path, _spawn_all(_save_worker, SAVE_WORLD, path, momentum_dtype)[0]
        return cache[momentum_dtype]
    return save


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for i, entry in want["state"].items():
        assert entry.keys() == got["state"][i].keys(), f"{what}: state {i}"
        for name, value in entry.items():
            np.testing.assert_array_equal(got["state"][i][name], value, err_msg=f"{what}: state {i} {name}")


def test_owners_differ_between_the_world_sizes():
    """The resharding below is real: matrices change owners from 2 to 3 ranks
    (the default bucket cap: one bucket)."""
    model = _Net()
    muon = _groups(model)[0]["params"]

    def owners(world):
        buckets = plan_owner_buckets([tuple(p.shape) for p in muon], [p.dtype for p in muon], world, cap=1 << 30)
        return {(m.param, m.index): m.owner for b in buckets for m in b.matrices}
    two, three = owners(2), owners(3)
    assert any(three[m] == 2 for m in three) and any(two[m] != three[m] for m in two), (two, three)


@pytest.mark.parametrize("load_world", [1, 2, 3])
def test_dcp_checkpoint_of_2_ranks_resumes_at_other_world_sizes(saved, load_world):
    path, before = saved(None)
    results = _spawn_all(_load_worker, load_world, path, None)
    want = _reference(torch.float32)
    for rank, result in enumerate(results):
        _assert_same_state(result["state"], before["state"], f"rank {rank} of {load_world}, loaded")
        for i, (got, w) in enumerate(zip(result["params"], want)):
            torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=2e-6,
                                       msg=lambda m: f"rank {rank} of {load_world}, param {i}: {m}")
        if load_world == SAVE_WORLD:  # the same owners and reductions: the uninterrupted run, bit for bit
            for i, (got, w) in enumerate(zip(result["params"], before["params"])):
                np.testing.assert_array_equal(got, w, err_msg=f"rank {rank}, param {i}")
    owned = [m for result in results for m in result["owned"]]
    assert sorted(owned, key=repr) == sorted([(0, None), (1, None), (2, 0), (2, 1), (2, 2)], key=repr)


@pytest.mark.parametrize("load_world", [2, 3])
def test_bf16_momentum_is_saved_in_the_parameter_dtype_and_loaded_exactly(saved, load_world):
    """momentum_dtype=bf16: the pieces are fp32 copies, written back into the
    bf16 slots on load; the state comes back exactly (bf16 -> fp32 -> bf16),
    and on the saving world size the run continues bit for bit."""
    path, before = saved(torch.bfloat16)
    results = _spawn_all(_load_worker, load_world, path, torch.bfloat16)
    momentum = before["state"]["state"][0]["momentum_buffer"]
    assert momentum.dtype == np.float32 and np.array_equal(
        torch.from_numpy(momentum).bfloat16().float().numpy(), momentum), "bf16 values, held in fp32"
    for rank, result in enumerate(results):
        _assert_same_state(result["state"], before["state"], f"rank {rank} of {load_world}, loaded")
        if load_world == SAVE_WORLD:
            for i, (got, w) in enumerate(zip(result["params"], before["params"])):
                np.testing.assert_array_equal(got, w, err_msg=f"rank {rank}, param {i}")


# ---------------------------------------------------------------- refusals


def _other_model() -> _Net:
    """_Net with four experts instead of three: another model."""
    model = _Net()
    model.experts = nn.Parameter(torch.randn(4, 20, 40) * 0.2)
    return model


def _snapshot(model, opt) -> dict:
    """Every value a load could write: parameters, the Muon momentum slots and
    flag, the AdamW engine's buffers, the groups' hyperparameters."""
    from test_sharded_checkpoint_checks import _buffers
    out = {f"param {i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    out.update({f"momentum {b}": t.clone() for b, t in enumerate(opt._muon.momentum)})
    out.update({f"adamw {name}": t for name, t in _buffers(opt._adamw).items()})
    out["stepped"] = torch.tensor(opt._muon.stepped)
    out.update({f"group {gi} {k}": torch.tensor(v) for gi, g in enumerate(opt.param_groups)
                for k, v in g.items() if k in ("lr", "weight_decay", "momentum", "betas", "step")})
    return out


def _refusal(call, kind) -> str | None:
    try:
        call()
    except kind as e:
        return str(e)
    return None


def _refusal_worker(rank, world, port, path, out) -> None:
    """An optimizer of _other_model with state of its own meets the checkpoint
    of _Net at `path`: check_sharded_checkpoint, dcp.load and
    load_sharded_state_dict (given _Net's structure) refuse it; and a
    structure only rank 1 refuses is refused on both. Nothing changes."""
    from torch.distributed.checkpoint.api import CheckpointException
    with _rank_group(rank, world, port, out):
        model = _other_model()
        opt = _optimizer(model)
        _train(model, opt, range(1), rank, world)
        before = _snapshot(model, opt)
        template = {"optim": opt.sharded_state_dict()}
        net_opt = _optimizer(_Net())
        fresh = _optimizer(_other_model()).sharded_state_dict()  # the state of an unstepped twin: zeros
        if rank == 1:
            fresh["state"].pop("0")
        result = dict(checked=_refusal(lambda: opt.check_sharded_checkpoint(path), ValueError),
                      dcp=_refusal(lambda: dcp.load(template, checkpoint_id=path), CheckpointException),
                      key=next(k for k in template["optim"] if k.startswith("layout_")),
                      handed=_refusal(lambda: opt.load_sharded_state_dict(net_opt.sharded_state_dict()), ValueError),
                      one_rank=_refusal(lambda: opt.load_sharded_state_dict(fresh), ValueError))
        after = _snapshot(model, opt)
        result["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
        out.put((rank, result))
    _exit()


def test_another_models_checkpoint_is_refused_on_every_rank_before_anything_is_written(saved):
    path, _ = saved(None)
    results = _spawn_all(_refusal_worker, 2, path)
    shape = (r"the checkpoint's trainable parameters \(in param_groups order\) differ from the optimizer's: "
             r"param_groups\[0\]\['params'\]\[2\] \(index 2\) has shape \(3, 20, 40\) in the checkpoint, "
             r"\(4, 20, 40\) in the optimizer")
    for rank, result in enumerate(results):
        assert result["changed"] == [], f"rank {rank} changed {result['changed']}"
        assert result["checked"] is not None and re.match(shape, result["checked"]), result["checked"]
        assert result["dcp"] is not None and f"Missing key in checkpoint state_dict: optim.{result['key']}." in \
            result["dcp"], result["dcp"]
        assert result["handed"] is not None and re.match(
            r"DistributedFusedMuon.load_sharded_state_dict refused on ranks 0, 1 of 2 \(nothing was loaded on any "
            r"rank\); rank 0: " + shape, result["handed"]), result["handed"]
        assert result["one_rank"] is not None and re.match(
            r"DistributedFusedMuon.load_sharded_state_dict refused on rank 1 of 2 .*rank 1: "
            r"sharded\['state'\]\['0'\]\['momentum_buffer'\] must be the momentum DTensor", result["one_rank"]), \
            result["one_rank"]
        for name in ("checked", "handed", "one_rank"):
            assert result[name] == results[0][name], f"rank {rank}: {name} differs from rank 0's"


# ---------------------------------------------------------------- one rank


@pytest.mark.parametrize("parts,steps", [("both", 0), ("muon", 2), ("adamw", 2)],
                         ids=["before-the-first-step", "muon-groups-only", "adamw-groups-only"])
def test_round_trip_on_one_rank(one_rank, tmp_path, parts, steps):
    """A checkpoint of an optimizer without AdamW groups, without Muon groups,
    or that never stepped (its state holds no momentum, as torch's) loads
    into one that stepped: the state is the saved one exactly."""
    def build():
        model = _Net()
        groups = _groups(model)
        groups = {"both": groups, "muon": groups[:1], "adamw": groups[1:]}[parts]
        return model, shardadam.DistributedFusedMuon(groups, ns_dtype=torch.float32, **OPTIONS)
    model, opt = build()
    _train(model, opt, range(steps))
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    want = _numpy(opt.state_dict())
    other, loaded = build()
    _train(other, loaded, range(STEPS - 1, STEPS))
    state = {"optim": loaded.sharded_state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    loaded.load_sharded_state_dict(state["optim"])
    _assert_same_state(_numpy(loaded.state_dict()), want, parts)
    assert ("momentum_buffer" in str(want)) == (parts != "adamw" and steps > 0)
