"""FusedAdam's low-bit storage kinds and host state (state_device="cpu") on
FSDP2 (fully_shard) parameters and through DCP, on gloo ranks on the CPU.

Each kind trains a model whose 300 x 64 weight's shards (150 rows of 64 at 2
ranks, 100 at 3) cut its 8-bit blocks of 256 elements mid-block, so blocks
straddle shard boundaries. A sharded optimizer quantizes per local shard
(8-bit blocks and FP8 scales from each shard's first element, stochastic
rounding keyed by the local element index), so its states round differently
from the same kind on the whole tensor: the runs are compared by their
parameter movement, whose difference must stay within the kind's own
rounding noise (its difference from fp32 storage on the plain model; fp32
storage itself agrees to fp32 rounding). The checkpoints hold fp32 values
(DTensors of the parameters' placements), so dcp.save at 2 ranks loads at 1
and at 3 ranks and training continues as the uninterrupted run did, within
the same noise. Host state runs its pipeline on the CPU parameters' local
shards (forced, in every rank: host_state_forced) and, with fp32 storage,
agrees with the plain model to fp32 rounding.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import shardadam
from shardadam._host_state import HostStateBucket
from test_distributed import _exit, _rank_group, _spawn_all
from test_host_state import host_state_forced

STEPS, SAVED_AT, GLOBAL_BATCH, LR = 6, 3, 12, 1e-2
KINDS = {
    "fp32": (torch.float32, {}),
    "8-bit": (torch.float32, dict(exp_avg_dtype=shardadam.BLOCKWISE8, exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
    "FP8": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
    "bf16 stochastic rounding": (torch.bfloat16, dict(bf16_stochastic_round=True, stochastic_round_seed=3)),
    "host state": (torch.float32, dict(state_device="cpu")),
    "host state 8-bit": (torch.float32, dict(state_device="cpu", exp_avg_dtype=shardadam.BLOCKWISE8,
                                             exp_avg_sq_dtype=shardadam.BLOCKWISE8)),
}
FP32_STORAGE = ("fp32", "host state")


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 64, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 1, generator=g)


def _model(dtype, mesh=None, device="cpu") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 1)).to(device, dtype)
    if mesh is not None:
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, steps, rank: int = 0, world: int = 1) -> None:
    """This rank's part of each global batch (FSDP2 averages the gradients)."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    x, y = (t.to(device) for t in _data())
    local = GLOBAL_BATCH // world
    for s in steps:
        opt.zero_grad()
        part = slice(rank * local, (rank + 1) * local)
        F.mse_loss(model(x[s, part].to(dtype)).float(), y[s, part]).backward()
        opt.step()


def _full(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone() for p in model.parameters()]


def _state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _load(model, opt, path: str) -> None:
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _resumed(kind: str, path: str, rank: int, world: int) -> list[torch.Tensor]:
    """The kind's checkpoint loaded on `world` ranks, trained on to STEPS."""
    dtype, kw = KINDS[kind]
    model = _model(dtype, init_device_mesh("cpu", (world,)))
    opt = shardadam.FusedAdam(model.parameters(), lr=LR, **kw)
    with host_state_forced():
        _load(model, opt, f"{path}/{kind}")
        _train(model, opt, range(SAVED_AT, STEPS), rank, world)
    return _full(model)


def _save_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """Every kind on 2 ranks: saved at SAVED_AT, the run continued to STEPS."""
    with _rank_group(rank, world, port, out), host_state_forced():
        mesh = init_device_mesh("cpu", (world,))
        result = {}
        for kind, (dtype, kw) in KINDS.items():
            model = _model(dtype, mesh)
            opt = shardadam.FusedAdam(model.parameters(), lr=LR, **kw)
            _train(model, opt, range(SAVED_AT), rank, world)
            result[kind + " on host buckets"] = all(isinstance(b, HostStateBucket) for b in opt._buckets)
            state = _state(model, opt)
            saved = [v for entry in state["optim"]["state"].values() for k, v in entry.items() if k != "step"]
            result[kind + " saves fp32 DTensors"] = all(isinstance(v, DTensor) and v.dtype == torch.float32
                                                         for v in saved)
            dcp.save(state, checkpoint_id=f"{path}/{kind}")
            _train(model, opt, range(SAVED_AT, STEPS), rank, world)
            result[kind] = [t.numpy() for t in _full(model)]
        out.put((rank, result))
    _exit()


def _load_worker(rank: int, world: int, port: int, path: str, out) -> None:
    with _rank_group(rank, world, port, out):
        out.put((rank, {kind: [t.numpy() for t in _resumed(kind, path, rank, world)] for kind in KINDS}))
    _exit()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(rank 0's results of the 2-rank runs, the checkpoints' folder)."""
    path = str(tmp_path_factory.mktemp("dcp-low-bit"))
    return _spawn_all(_save_worker, 2, path)[0], path


@pytest.fixture(scope="module")
def resumed_on_three(saved):
    """Every kind's checkpoint resumed on 3 ranks (rank 0's results)."""
    return _spawn_all(_load_worker, 3, saved[1])[0]


@functools.lru_cache(maxsize=None)
def _plain(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(initial, final) parameters of the kind on the unsharded model, one process, the global batch."""
    dtype, kw = KINDS[kind]
    model = _model(dtype)
    start = _full(model)
    with host_state_forced():
        _train(model, shardadam.FusedAdam(model.parameters(), lr=LR, **kw), range(STEPS))
    return start, _full(model)


def _movement_error(got: list, want: list, start: list) -> float:
    """|got - want| over |want - start|, over all parameters (Frobenius)."""
    num = sum(float((torch.as_tensor(g).float() - w).square().sum()) for g, w in zip(got, want))
    den = sum(float((w - s).square().sum()) for w, s in zip(want, start))
    return (num / den) ** 0.5


def _noise(kind: str) -> float:
    """How far the kind's own rounding moves a run: its plain run against fp32 storage's (the
    bound for the sharded runs, twice that to be safe; fp32 storage: fp32 rounding)."""
    if kind in FP32_STORAGE:
        return 1e-6
    start, fp32 = _plain("fp32")
    return 2 * _movement_error(_plain(kind)[1], fp32, start)


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_training_equals_the_plain_model_within_the_kinds_rounding(saved, kind):
    result, _ = saved
    assert result[kind + " saves fp32 DTensors"], "the checkpoint holds the stored codes, not fp32 values"
    assert result[kind + " on host buckets"] == ("state_device" in KINDS[kind][1]), "stepped on the wrong buckets"
    start, plain = _plain(kind)
    error = _movement_error(result[kind], plain, start)
    assert error <= _noise(kind), f"{kind}: the sharded run moved {error:.2%} away from the plain one"


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_checkpoint_of_2_ranks_resumes_on_1_and_3(saved, resumed_on_three, kind):
    result, path = saved
    start, _ = _plain(kind)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        on_one = _resumed(kind, path, 0, 1)
    finally:
        dist.destroy_process_group()
    on_three = resumed_on_three[kind]
    for world, got in ((1, on_one), (3, on_three)):
        error = _movement_error(got, [torch.as_tensor(t) for t in result[kind]], start)
        assert error <= _noise(kind), f"{kind} resumed on {world} ranks: {error:.2%} away from the 2-rank run"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["host state", "host state 8-bit"])
def test_host_state_of_cuda_shards_equals_the_same_kind_on_the_gpu(kind):
    """state_device="cpu" on fully_shard CUDA parameters (one NCCL rank): the
    page-locked shadows of the local shards and the copies on their own
    streams train as the kind with its state on the GPU (fp32: to fp32
    rounding; 8-bit: within its own rounding noise)."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        mesh = init_device_mesh("cuda", (1,))
        dtype, kw = KINDS[kind]
        on_gpu = {k: v for k, v in kw.items() if k != "state_device"}
        runs = []
        for options in (on_gpu, kw):
            model = _model(dtype, mesh, "cuda")
            start = [t.cpu() for t in _full(model)]
            opt = shardadam.FusedAdam(model.parameters(), lr=LR, **options)
            _train(model, opt, range(STEPS))
            runs.append([t.cpu() for t in _full(model)])
        assert all(isinstance(b, HostStateBucket) for b in opt._buckets), "host state did not run"
    finally:
        dist.destroy_process_group()
    error = _movement_error(runs[1], runs[0], start)
    assert error <= (1e-6 if kind in FP32_STORAGE else _noise(kind)), f"{kind}: {error:.2e} from the GPU state"
