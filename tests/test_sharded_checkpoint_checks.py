"""DistributedFusedAdam.load_sharded_state_dict on one gloo rank in this
process: it refuses pieces of another layout before writing anything, and
copies only the states whose pieces are not views of its own buffers."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from conftest import assert_bits_equal

# DCP takes the DTensor pieces without the deprecation warnings of ShardedTensor.
pytestmark = [pytest.mark.filterwarnings("error::FutureWarning"), pytest.mark.filterwarnings("error::DeprecationWarning")]




def _optimizer(bucket_cap_mb: float, param_dtype=torch.float32, lr: float = 1e-2, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)).to(param_dtype)
    # No overlap: the layout stays the one built here (no reordering at the first step).
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=lr, weight_decay=0.1, bucket_cap_mb=bucket_cap_mb,
                                         overlap_grad_sync=False, **kw)
    return model, opt


def _train(model, opt, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)
        opt.zero_grad()
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()


def _buffers(opt) -> dict:
    out = {n: getattr(opt, n).clone() for n in ("master", "remainders") if getattr(opt, n) is not None}
    out.update({f"param_shards {i}": t.clone() for i, t in enumerate(opt.param_shards.tensors)})
    out.update({n: t.clone() for n, t in opt.states.items()})
    return out


def _pieces(opt, key: str) -> int:
    """How many pieces of parameter `key` (its index in param_groups order) this rank holds."""
    p = [q for g in opt.param_groups for q in g["params"]][int(key)]
    k = next(i for i, q in enumerate(opt.params) if q is p)
    return sum(f.param == k for f in opt._shard_fragments)


def test_pieces_of_another_layout_are_refused_before_anything_is_written(one_rank):
    """One bucket for all against buckets of 32 elements: the first weight
    (96 elements) is one piece in one layout, three in the other."""
    _, whole = _optimizer(bucket_cap_mb=100, lr=0.5)
    _, split = _optimizer(bucket_cap_mb=1e-4)
    assert (_pieces(whole, "0"), _pieces(split, "0")) == (1, 3)
    template = whole.sharded_state_dict()
    before = _buffers(split)
    with pytest.raises(ValueError, match=r"state 0 \(param\): the sharded state dict holds 1 pieces on this rank, "
                                         r"the optimizer 3"):
        split.load_sharded_state_dict(template)
    assert split.param_groups[0]["lr"] == 1e-2, "the groups' hyperparameters are untouched"
    for name, value in _buffers(split).items():
        assert_bits_equal(value, before[name], name)


def test_a_table_of_another_parameter_count_is_refused_by_name(one_rank):
    """load_sharded_state_dict's own check of the parameter table (what a
    partial-load planner lets through), before anything is written."""
    _, opt = _optimizer(bucket_cap_mb=100)
    sharded = opt.sharded_state_dict()
    sharded["params"] = json.dumps(json.loads(sharded["params"])[:-1])
    sharded.pop("shapes")
    before = _buffers(opt)
    with pytest.raises(ValueError, match=r"the checkpoint has 3 trainable parameters \[\[0, 96\], \[1, 8\], "
                                         r"\[2, 24\]\], the optimizer 4 \[\[0, 96\], "):
        opt.load_sharded_state_dict(sharded)
    for name, value in _buffers(opt).items():
        assert_bits_equal(value, before[name], name)


@pytest.mark.parametrize("dtype, kw, temporaries", [
    (torch.float32, dict(store_params=True), set()),
    (torch.float32, dict(amsgrad=True, store_params=True), set()),
    (torch.float32, {}, {"master"}),  # the default for fp32: the parameter shard is the master
    (torch.bfloat16, {}, set()),
    (torch.bfloat16, dict(store_param_remainders=True, store_params=False), {"master"}),
    (torch.bfloat16, dict(with_scaled_states=True, dtype=torch.float16), {"master", "exp_avg", "exp_avg_sq"}),
], ids=["fp32-masters", "amsgrad", "fp32-default", "bf16-masters", "remainders", "scaled-states"])
def test_dcp_load_copies_only_temporaries(one_rank, tmp_path, dtype, kw, temporaries, monkeypatch):
    """Saved with one bucket size, loaded with another: pieces that are views
    of the optimizer's fp32 buffers were filled in place by dcp.load and are
    not copied onto themselves; the others are written, and the loaded state
    is exactly the saved one."""
    model, opt = _optimizer(1e-4, dtype, **kw)
    _train(model, opt)
    dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    want = opt.state_dict()

    other, loaded = _optimizer(100, dtype, **kw)
    with torch.no_grad():  # every value must come from the checkpoint
        for p in other.parameters():
            p.add_(1.0)
    state = {"optim": loaded.sharded_state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    written = []
    write = loaded._write_state
    monkeypatch.setattr(loaded, "_write_state", lambda name, f, values: (written.append(name), write(name, f, values)))
    loaded.load_sharded_state_dict(state["optim"])

    assert set(written) == temporaries
    got = loaded.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k, entry in want["state"].items():
        for name, value in entry.items():
            assert_bits_equal(got["state"][k][name], value, f"state {k} {name}")
    for i, (p, q) in enumerate(zip(other.parameters(), model.parameters())):
        # Scaled states: the saved model's bf16 parameters were rounded from
        # the master before it was stored in fp16, the loaded ones from the
        # stored master.
        expected = want["state"][i]["param"].to(dtype).view_as(q) if "with_scaled_states" in kw else q.detach()
        assert_bits_equal(p.detach(), expected, f"param {i}")


# ---------------------------------------------------------------- checkpoints of another layout
#
# sharded_state_dict() hands DCP live views of the optimizer's fp32 buffers, so
# dcp.load writes into the optimizer before load_sharded_state_dict can check
# anything. A checkpoint of other parameters must therefore be refused by DCP
# while it plans, before it reads: the structure holds a small tensor under
# layout_<hash of the [index, shape] table>, which such a checkpoint lacks.


class _Shaped(nn.Module):
    """Parameters of the given shapes (and memory formats), filled from `seed`."""

    def __init__(self, shapes, seed: int, channels_last=()):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(s, generator=g) for s in shapes]
        tensors = [t.to(memory_format=torch.channels_last) if i in channels_last else t for i, t in enumerate(tensors)]
        self.ps = nn.ParameterList([nn.Parameter(t) for t in tensors])


SAVED = [(8, 12), (8,), (3, 8), (3,)]
OTHER_LAYOUTS = {
    "transposed": [(12, 8), (8,), (8, 3), (3,)],       # the same numel everywhere: passes DCP's size check
    "other-count": [(8, 12), (8,), (27,)],             # the same total size, one parameter fewer
}


def _shaped_optimizer(shapes, seed: int, steps: int = 2, **kw):
    model = _Shaped(shapes, seed, **kw)
    opt = shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4, overlap_grad_sync=False)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):  # states that differ from the other model's
        for p in model.parameters():  # in the parameter's memory format
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))
        opt.step()
    return model, opt


def _live(opt, model) -> dict:
    out = _buffers(opt)
    out.update({f"param {i}": p.detach().clone() for i, p in enumerate(model.parameters())})
    return out


def _assert_same(now: dict, before: dict, what: str) -> None:
    for name, value in before.items():
        assert_bits_equal(now[name], value, f"{what}: {name}")


@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_dcp_refuses_another_layout_while_planning(one_rank, tmp_path, layout):
    """dcp.load of a checkpoint of other parameters (equal numel, or an equal
    total size) fails in DCP's planning with a missing-key error naming the
    layout key, and every live buffer and parameter is bit-identical after it."""
    from torch.distributed.checkpoint.api import CheckpointException
    _, saved = _shaped_optimizer(SAVED, seed=0)
    dcp.save({"optim": saved.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    model, opt = _shaped_optimizer(OTHER_LAYOUTS[layout], seed=1)
    template = {"optim": opt.sharded_state_dict()}
    key = next(k for k in template["optim"] if k.startswith("layout_"))
    before = _live(opt, model)
    with pytest.raises(CheckpointException, match=rf"Missing key in checkpoint state_dict: optim\.{key}\."):
        dcp.load(template, checkpoint_id=str(tmp_path))
    _assert_same(_live(opt, model), before, "after the refused dcp.load")
    # Handed over directly, the other optimizer's structure is refused by the tables, naming the parameter.
    words = {"transposed": r"param_groups\[0\]\['params'\]\[0\] \(index 0\) has shape \(8, 12\) in the checkpoint, "
                           r"\(12, 8\) in the optimizer",
             "other-count": r"sharded\['param_groups'\]\[0\] lists 4 parameters, the optimizer's group 0 has 3"}[layout]
    with pytest.raises(ValueError, match=words):
        opt.load_sharded_state_dict(saved.sharded_state_dict())
    _assert_same(_live(opt, model), before, "after the refused load_sharded_state_dict")


def test_without_the_layout_key_dcp_would_write_the_live_buffers(one_rank, tmp_path):
    """The control, as checkpoints were before the layout key and the shape
    table: the transposed model passes DCP (equal sizes) and dcp.load writes
    the optimizer's live buffers; its [index, numel] table is equal too, so
    nothing can tell. With the key (the tests above) nothing is written."""
    _, saved = _shaped_optimizer(SAVED, seed=0)
    def old(sharded):  # the structure of a checkpoint written before the layout key and the shape table
        return {k: v for k, v in sharded.items() if not k.startswith("layout_") and k != "shapes"}
    dcp.save({"optim": old(saved.sharded_state_dict())}, checkpoint_id=str(tmp_path))
    model, opt = _shaped_optimizer(OTHER_LAYOUTS["transposed"], seed=1)
    before = _live(opt, model)
    template = {"optim": old(opt.sharded_state_dict())}
    dcp.load(template, checkpoint_id=str(tmp_path))
    assert not torch.equal(opt.states["exp_avg"], before["exp_avg"]), "dcp.load wrote the live exp_avg"
    assert template["optim"]["params"] == old(opt.sharded_state_dict())["params"], "equal [index, numel] tables"


def test_memory_format_is_part_of_the_layout(one_rank, tmp_path):
    """The flat space holds each parameter in memory order: a channels_last
    checkpoint into a contiguous parameter would scramble it, and is refused."""
    from torch.distributed.checkpoint.api import CheckpointException
    shapes = [(4, 3, 2, 2), (4,)]
    _, saved = _shaped_optimizer(shapes, seed=0, channels_last=(0,))
    dcp.save({"optim": saved.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    model, opt = _shaped_optimizer(shapes, seed=1)
    before = _live(opt, model)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim.layout_"):
        dcp.load({"optim": opt.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    with pytest.raises(ValueError, match=r"lies in memory with its dims in the order \(0, 2, 3, 1\) in the "
                                         r"checkpoint, \(0, 1, 2, 3\) in the optimizer"):
        opt.load_sharded_state_dict(saved.sharded_state_dict())
    _assert_same(_live(opt, model), before, "after the refusals")


def test_checkpoints_without_the_layout_key_load_with_partial_planning(one_rank, tmp_path):
    """A checkpoint written before the layout key and shape table (only
    [index, numel]): strict dcp.load refuses it (missing layout key); with
    DefaultLoadPlanner(allow_partial_load=True) it loads, the numel table
    is compared, and the state is the saved one."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException
    _, saved = _shaped_optimizer(SAVED, seed=0)
    old = {k: v for k, v in saved.sharded_state_dict().items() if not k.startswith("layout_") and k != "shapes"}
    dcp.save({"optim": old}, checkpoint_id=str(tmp_path))
    want = saved.state_dict()
    model, opt = _shaped_optimizer(SAVED, seed=1)
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim.layout_"):
        dcp.load({"optim": opt.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    state = {"optim": opt.sharded_state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True))
    opt.load_sharded_state_dict(state["optim"])
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k, entry in want["state"].items():
        for name, value in entry.items():
            assert_bits_equal(got["state"][k][name], value, f"state {k} {name}")


def _dcp_layout_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """2 ranks: save a checkpoint of SAVED, then check_sharded_checkpoint and
    dcp.load it into an optimizer of each other layout: both ranks must get
    shardadam's error naming the parameter, then DCP's missing-key error, and
    keep every live buffer and parameter bit-identical."""
    from test_distributed import _exit, _rank_group
    from torch.distributed.checkpoint.api import CheckpointException
    with _rank_group(rank, world, port, out):
        _, saved = _shaped_optimizer(SAVED, seed=0)
        dcp.save({"optim": saved.sharded_state_dict()}, checkpoint_id=path)
        result = {}
        for name, shapes in OTHER_LAYOUTS.items():
            model, opt = _shaped_optimizer(shapes, seed=1)
            template = {"optim": opt.sharded_state_dict()}
            before = _live(opt, model)
            try:
                opt.check_sharded_checkpoint(path)
                checked = None
            except ValueError as e:
                checked = str(e)
            try:
                dcp.load(template, checkpoint_id=path)
                message = None
            except CheckpointException as e:
                message = str(e)
            try:
                _assert_same(_live(opt, model), before, f"rank {rank}, {name}")
                unchanged = None
            except AssertionError as e:
                unchanged = str(e)
            key = next(k for k in template["optim"] if k.startswith("layout_"))
            result[name] = dict(message=message, unchanged=unchanged, key=key, checked=checked)
            del opt
        del saved
        out.put((rank, result))
    _exit()


def test_dcp_refuses_another_layout_on_two_ranks(tmp_path):
    from test_distributed import _spawn_all
    results = _spawn_all(_dcp_layout_worker, 2, str(tmp_path / "ckpt"))
    for rank, result in enumerate(results):
        for name, r in result.items():
            assert r["message"] is not None, f"rank {rank}, {name}: dcp.load did not refuse"
            assert f"Missing key in checkpoint state_dict: optim.{r['key']}." in r["message"], r["message"][-600:]
            assert r["unchanged"] is None, r["unchanged"]
            assert r["checked"] is not None and r["checked"] == results[0][name]["checked"], (rank, r["checked"])
            assert "the checkpoint's trainable parameters (in param_groups order) differ" in r["checked"], r["checked"]


@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_check_sharded_checkpoint_names_the_parameter_before_dcp_plans(one_rank, tmp_path, layout):
    """check_sharded_checkpoint reads only the checkpoint's tables: another
    model's checkpoint is refused naming the first parameter that differs, and
    nothing of the optimizer or model changes; the optimizer's own passes."""
    _, saved = _shaped_optimizer(SAVED, seed=0)
    dcp.save({"optim": saved.sharded_state_dict()}, checkpoint_id=str(tmp_path))
    saved.check_sharded_checkpoint(str(tmp_path))
    model, opt = _shaped_optimizer(OTHER_LAYOUTS[layout], seed=1)
    before = _live(opt, model)
    words = {"transposed": r"param_groups\[0\]\['params'\]\[0\] \(index 0\) has shape \(8, 12\) in the checkpoint, "
                           r"\(12, 8\) in the optimizer",
             "other-count": r"the checkpoint has 4 trainable parameters .*, the optimizer 3"}[layout]
    with pytest.raises(ValueError, match=words):
        opt.check_sharded_checkpoint(str(tmp_path))
    _assert_same(_live(opt, model), before, "after the refused check")
    with pytest.raises(ValueError, match=r"holds no sharded_state_dict\(\) under 'model'"):
        opt.check_sharded_checkpoint(str(tmp_path), key="model")
