"""The engine's state I/O (distributed/_state_io.py) on a one-rank optimizer
in this process: each storage codec's write and read of a shard fragment,
the parameter shard following a written master, and the portable state dict
carried across bucket sizes. Spawned runs (test_distributed.py,
test_sharded_checkpoint_checks.py) cover several ranks."""
from __future__ import annotations

import pytest
import torch

import shardadam
from conftest import assert_bits_equal

# Storage options, and the largest relative error a write and read may add.
CODECS = {
    "fp32": (dict(), 0.0),
    "bf16 states": (dict(dtype=torch.bfloat16), None),  # exactly the bf16 rounding
    "scaled fp16": (dict(dtype=torch.float16, with_scaled_states=True), 2.0 ** -11),
    "bf16 + remainders": (dict(store_params=False, store_param_remainders=True), 0.0),
}


def _model(dtype=torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)


def _optimizer(model, **kw):
    return shardadam.DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=4e-5, **kw)


@pytest.mark.parametrize("codec", CODECS)
def test_each_fragment_reads_back_what_was_written(one_rank, codec):
    options, rel = CODECS[codec]
    model = _model(torch.bfloat16 if "remainders" in codec else torch.float32)
    opt = _optimizer(model, **options)
    assert len(opt.layout.buckets) > 1  # fragments in several buckets
    assert bool(opt.state_scales) == (codec == "scaled fp16")
    assert (opt.remainders is not None) == (codec == "bf16 + remainders")
    written = {}
    for name in opt._state_names:
        for f in opt._shard_fragments:
            values = torch.randn(f.shard_end - f.shard_start, dtype=torch.float64).float()
            opt._write_state(name, f, values)
            written[name, f.bucket, f.shard_start] = values
    for (name, b, start), values in written.items():
        got = opt._state_row(name, b)[start:start + values.numel()]
        assert got.dtype == torch.float32
        if rel is None:
            assert_bits_equal(got, values.to(torch.bfloat16).float(), f"{name} bucket {b} at {start}")
        elif rel == 0.0:
            assert_bits_equal(got, values, f"{name} bucket {b} at {start}")
        else:
            err = (got.double() - values.double()).abs()
            assert (err <= rel * values.double().abs()).all(), f"{name} bucket {b} at {start}: {err.max()}"


def test_a_written_master_reaches_the_parameter_shard(one_rank):
    """bf16 state over fp32 parameters: the all-gather sends a shard of its
    own, which follows the master written outside a step."""
    opt = _optimizer(_model(), dtype=torch.bfloat16)
    assert opt.separate_param_shards
    f = opt._shard_fragments[0]
    values = torch.randn(f.shard_end - f.shard_start)
    opt._write_state("master", f, values)
    assert_bits_equal(opt.param_shards[f.bucket, f.shard_start:f.shard_end], values.to(torch.bfloat16).float())


def _train(model, opt, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()


def test_portable_state_dict_carries_across_bucket_sizes(one_rank):
    model = _model()
    opt = _optimizer(model)
    _train(model, opt)
    saved = opt.state_dict()
    other = _model()
    loaded = shardadam.DistributedFusedAdam(other.parameters(), lr=5.0, bucket_cap_mb=1.0)
    assert len(loaded.layout.buckets) == 1 != len(opt.layout.buckets)
    loaded.load_state_dict(saved)
    again = loaded.state_dict()
    assert again["param_groups"] == saved["param_groups"]
    assert again["state"].keys() == saved["state"].keys()
    for k, entry in saved["state"].items():
        assert again["state"][k].keys() == entry.keys() == {"param", "exp_avg", "exp_avg_sq"}
        for name, value in entry.items():
            assert_bits_equal(again["state"][k][name], value, f"state {k} {name}")
    for p, q in zip(other.parameters(), model.parameters()):
        assert_bits_equal(p.detach(), q.detach())
