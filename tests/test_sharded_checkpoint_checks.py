"""DistributedFusedAdam.load_sharded_state_dict on one gloo rank in this
process: it refuses pieces of another layout before writing anything, and
copies only the states whose pieces are not views of its own buffers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import shardadam
from conftest import assert_bits_equal

# The sharded format is ShardedTensors on purpose (see sharded_checkpoint.py);
# DCP warns about them on every save and load.
pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor:FutureWarning")




def _optimizer(bucket_cap_mb: float, dtype=torch.float32, lr: float = 1e-2, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
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
    names = ("master", "remainders", "exp_avg", "exp_avg_sq", "param_shards")
    return {n: getattr(opt, n).clone() for n in names if getattr(opt, n) is not None}


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


@pytest.mark.parametrize("dtype, kw, temporaries", [
    (torch.float32, {}, set()),
    (torch.float32, dict(amsgrad=True), set()),
    (torch.float32, dict(store_params=False), {"master"}),
    (torch.bfloat16, {}, set()),
    (torch.bfloat16, dict(store_param_remainders=True), {"master"}),
    (torch.bfloat16, dict(with_scaled_states=True), {"master", "exp_avg", "exp_avg_sq"}),
], ids=["fp32", "amsgrad", "store_params-false", "bf16-masters", "remainders", "scaled-states"])
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
