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

import json
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardadam
from test_distributed import _exit, _numpy, _rank_group, _spawn_all
from test_distributed_muon import OPTIONS, STEPS, _groups, _Net, _reference, _train

SAVE_WORLD, SAVED_STEPS = 2, 2

# DCP takes the ragged DTensors without the deprecation warnings of ShardedTensor (the one-rank tests run DCP here).
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"),
              pytest.mark.filterwarnings("error::DeprecationWarning")]


def _optimizer(model, momentum_dtype=None):
    return shardadam.DistributedFusedMuon(_groups(model), ns_dtype=torch.float32, momentum_dtype=momentum_dtype,
                                          **OPTIONS)


def _params(model) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def _model(rank: int, device: str) -> _Net:
    """_Net on this rank's device (one GPU per rank with NCCL)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    return _Net().to(f"cuda:{rank}" if device == "cuda" else "cpu")


def _save_worker(rank, world, port, path, momentum_dtype, device, out) -> None:
    """SAVED_STEPS steps, dcp.save, then the rest of the run uninterrupted."""
    model = _model(rank, device)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        opt = _optimizer(model, momentum_dtype)
        _train(model, opt, range(SAVED_STEPS), rank, world)
        dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=path)
        state = _numpy(opt.state_dict())
        _train(model, opt, range(SAVED_STEPS, STEPS), rank, world)
        out.put((rank, dict(state=state, params=_params(model), owned=opt.orthogonalized_matrices())))
    _exit()


def _load_worker(rank, world, port, path, momentum_dtype, device, out) -> None:
    """A step of its own, then check, dcp.load and load the checkpoint and
    take the steps after it."""
    model = _model(rank, device)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
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
    """The checkpoints of 2 ranks (or world), by momentum_dtype and device:
    (path, rank 0's result and the matrices' owners)."""
    cache = {}

    def save(momentum_dtype=None, device="cpu", world=SAVE_WORLD):
        key = momentum_dtype, device, world
        if key not in cache:
            path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
            results = _spawn_all(_save_worker, world, path, momentum_dtype, device)
            cache[key] = path, dict(results[0], owners=_owners(results))
        return cache[key]
    return save


def _owners(results: list) -> dict:
    """Each matrix's owner, from every rank's orthogonalized_matrices()."""
    return {m: rank for rank, result in enumerate(results) for m in result["owned"]}


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for i, entry in want["state"].items():
        assert entry.keys() == got["state"][i].keys(), f"{what}: state {i}"
        for name, value in entry.items():
            np.testing.assert_array_equal(got["state"][i][name], value, err_msg=f"{what}: state {i} {name}")


@pytest.mark.parametrize("save_world,load_world,device", [
    (2, 1, "cpu"), (2, 2, "cpu"), (2, 3, "cpu"),
    pytest.param(1, 1, "cuda", marks=pytest.mark.cuda),
    pytest.param(2, 1, "cuda", marks=pytest.mark.multigpu),
], ids=["2-to-1", "2-to-2", "2-to-3", "nccl-1-to-1", "nccl-2-to-1"])
def test_dcp_checkpoint_resumes_at_other_world_sizes(saved, save_world, load_world, device):
    path, before = saved(device=device, world=save_world)
    results = _spawn_all(_load_worker, load_world, path, None, device)
    want = _reference(torch.float32, device=device)
    for rank, result in enumerate(results):
        _assert_same_state(result["state"], before["state"], f"rank {rank} of {load_world}, loaded")
        for i, (got, w) in enumerate(zip(result["params"], want)):
            torch.testing.assert_close(torch.from_numpy(got), w, rtol=1e-5, atol=2e-6,
                                       msg=lambda m: f"rank {rank} of {load_world}, param {i}: {m}")
        if load_world == save_world:  # the same owners and reductions: the uninterrupted run, bit for bit
            for i, (got, w) in enumerate(zip(result["params"], before["params"])):
                np.testing.assert_array_equal(got, w, err_msg=f"rank {rank}, param {i}")
    owners = _owners(results)
    assert sorted(owners, key=repr) == sorted(before["owners"], key=repr) == sorted(
        [(0, None), (1, None), (2, 0), (2, 1), (2, 2)], key=repr)
    if load_world == 3:  # the matrices have other owners: DCP hands each rank other pieces than were saved
        assert any(owners[m] != before["owners"][m] for m in owners), (before["owners"], owners)


@pytest.mark.parametrize("load_world", [2, 3])
def test_bf16_momentum_is_saved_in_the_parameter_dtype_and_loaded_exactly(saved, load_world):
    """momentum_dtype=bf16: the pieces are fp32 copies, written back into the
    bf16 slots on load; the state comes back exactly (bf16 -> fp32 -> bf16),
    and on the saving world size the run continues bit for bit."""
    path, before = saved(torch.bfloat16)
    results = _spawn_all(_load_worker, load_world, path, torch.bfloat16, "cpu")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert metadata["optim.state.0.momentum_buffer"].properties.dtype == torch.float32
    momentum = before["state"]["state"][0]["momentum_buffer"]
    assert np.array_equal(torch.from_numpy(momentum).bfloat16().float().numpy(), momentum), "bf16 values"
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
    structure only rank 1 refuses (its momentum, or its AdamW groups' part)
    is refused on both. Nothing changes."""
    from torch.distributed.checkpoint.api import CheckpointException
    with _rank_group(rank, world, port, out):
        model = _other_model()
        opt = _optimizer(model)
        _train(model, opt, range(1), rank, world)
        before = _snapshot(model, opt)
        template = {"optim": opt.sharded_state_dict()}
        net_opt = _optimizer(_Net())
        twin = _optimizer(_other_model())  # unstepped: its state is zeros
        fresh, adamw_bad = twin.sharded_state_dict(), twin.sharded_state_dict()
        if rank == 1:
            fresh["state"].pop("0")
            groups = json.loads(adamw_bad["adamw"]["param_groups"])
            groups[0]["lr"] = float("inf")
            adamw_bad["adamw"]["param_groups"] = json.dumps(groups)
        result = dict(checked=_refusal(lambda: opt.check_sharded_checkpoint(path), ValueError),
                      dcp=_refusal(lambda: dcp.load(template, checkpoint_id=path), CheckpointException),
                      key=next(k for k in template["optim"] if k.startswith("layout_")),
                      handed=_refusal(lambda: opt.load_sharded_state_dict(net_opt.sharded_state_dict()), ValueError),
                      one_rank=_refusal(lambda: opt.load_sharded_state_dict(fresh), ValueError),
                      adamw=_refusal(lambda: opt.load_sharded_state_dict(adamw_bad), ValueError))
        after = _snapshot(model, opt)
        result["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
        out.put((rank, result))
    _exit()


def test_another_models_checkpoint_is_refused_on_every_rank_before_anything_is_written(saved):
    path, _ = saved()
    results = _spawn_all(_refusal_worker, 2, path)
    shape = (r"the checkpoint's trainable parameters \(in param_groups order\) differ from the optimizer's: "
             r"param_groups\[0\]\['params'\]\[2\] \(index 2\) has shape \(3, 20, 40\) in the checkpoint, "
             r"\(4, 20, 40\) in the optimizer")
    refused = r"DistributedFusedMuon.load_sharded_state_dict refused on "
    expected = {
        "checked": shape,
        "handed": refused + r"ranks 0, 1 of 2 \(nothing was loaded on any rank\); rank 0: " + shape,
        "one_rank": refused + r"rank 1 of 2 .*; rank 1: sharded\['state'\]\['0'\]\['momentum_buffer'\] must be "
                              r"the momentum DTensor",
        "adamw": refused + r"rank 1 of 2 .*; rank 1: sharded\['adamw'\] \(the AdamW groups' DistributedFusedAdam\): "
                           r"sharded\['param_groups'\]\[0\]: lr must be finite",
    }
    for rank, result in enumerate(results):
        assert result["changed"] == [], f"rank {rank} changed {result['changed']}"
        assert result["dcp"] is not None and f"Missing key in checkpoint state_dict: optim.{result['key']}." in \
            result["dcp"], result["dcp"]
        for name, pattern in expected.items():
            assert result[name] is not None and re.match(pattern, result[name]), f"rank {rank}, {name}: {result[name]}"
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
    if steps == 0:  # the loading optimizer's own momentum is gone too, where state_dict() shows none
        assert not any(t.any() for t in loaded._muon.momentum)


@pytest.mark.parametrize("parts", ["both", "muon"], ids=["with-adamw-groups", "muon-groups-only"])
def test_sharded_state_dict_is_refused_with_a_redundant_group(one_rank, parts):
    """Every replica would write the same pieces, as DistributedFusedAdam
    refuses: sharded_state_dict() raises, naming the option, so that nothing
    reaches dcp.save (a one-rank redundant group is one all the same)."""
    model = _Net()
    groups = _groups(model) if parts == "both" else _groups(model)[:1]
    opt = shardadam.DistributedFusedMuon(groups, **OPTIONS, redundant_process_group=dist.new_group([0]))
    _train(model, opt, range(1))
    with pytest.raises(NotImplementedError, match=r"^sharded_state_dict with a redundant_process_group: .*"
                                                  r"use state_dict\(\) \(portable\)"):
        opt.sharded_state_dict()
