"""FusedMuon on FSDP2 (fully_shard) parameters, on gloo ranks on the CPU
([Note: Muon on sharded matrices] in python/shardadam/_muon_dtensor.py):
1-D meshes of 2 and 3 ranks, and HSDP's 2 x 2 mesh (2 replicas of 2 shards).

The model's Muon matrices come in several shapes: two 24 x 16 (tall, one
batch), a 7 x 12 (wide; 4 + 3 rows at 2 ranks, 3 + 3 + 1 at 3) and a 2 x 7
(1 + 1 + 0 rows at 3 ranks: a rank with none), plus a 3-D parameter of 5
experts' 24 x 12 matrices (3 + 2, 2 + 2 + 1 experts, 3 + 2 in each HSDP
replica: whole matrices on each rank); biases and the norm are an AdamW
group. Each layer is fully_shard-ed, each rank trains on its part of the
global batch (FSDP2 averages the gradients, over the replicas too), and the
result is compared with FusedMuon on the same model unsharded, in one
process, on the global batch; under HSDP every rank's result is compared, so
every replica is checked.

With ns_dtype=float32 the two runs differ only by fp32 rounding: FSDP2's
averaged gradients sum in another order than the global batch's backward
(relative differences ~1e-7), which the momentum pass, Newton-Schulz and the
update carry into the parameters. The parameters move by up to 0.06 in 6
steps; the runs agree to 4.2e-7 (measured: 2, 3 and 2 x 2 ranks), checked at
atol 1e-5: room for another BLAS's summation order, and far below a
misplaced update (another matrix's or another shard's rows, a replica left
with its Newton-Schulz input, an lr ratio from the local shape: differences
of the size of a step, ~1e-2). With the default bf16 ns_dtype the same
fp32-level input differences flip bf16 roundings inside Newton-Schulz, so
the runs differ by bf16 noise: the sharded run must stay as close to the
plain bf16 run as twice the bf16 run's own distance from the fp32 one (5% of
the parameters' movement, measured each time, not assumed), in the low-bit
tests' movement measure (measured: 1e-7 at 2 ranks, 3.5% at 3, 3.6% at 2 x
2).
"""
from __future__ import annotations

import functools
import math
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import shardadam
from shardadam import _muon_dtensor, _muon_layout, _newton_schulz
from test_distributed import _exit, _rank_group, _spawn_all
from test_fsdp2_low_bit import _full, _load, _movement_error, _state

STEPS, SAVED_AT, GLOBAL_BATCH, MUON_LR, ADAMW_LR = 6, 3, 12, 0.02, 1e-2
MESHES = [(2,), (3,), (2, 2)]  # mesh shapes: FSDP2's 1-D meshes, and HSDP's (replicas, shards)
HSDP_DIMS = ("dp_replicate", "dp_shard")
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATRICES = {(24, 16): 2, (24, 12): 5, (7, 12): 1, (2, 7): 1}  # the Muon matrices: shape -> count
NEWTON_SCHULZ = _muon_layout.newton_schulz_


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 24, 12) / 24 ** 0.5)

    def forward(self, x):
        return torch.einsum("bi,eio->bo", x, self.weight) / self.weight.size(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.gate = nn.Linear(16, 24), nn.Linear(16, 24)
        self.experts = Experts()
        self.norm = nn.LayerNorm(12)
        self.down, self.head = nn.Linear(12, 7), nn.Linear(7, 2)

    def forward(self, x):
        h = self.experts(torch.tanh(self.up(x)) * torch.sigmoid(self.gate(x)))
        return self.head(torch.tanh(self.down(self.norm(h))))


def _model(mesh=None) -> Model:
    torch.manual_seed(0)
    model = Model()
    if mesh is not None:
        for layer in model.children():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _optimizer(model, ns_dtype) -> shardadam.FusedMuon:
    params = list(model.parameters())
    return shardadam.FusedMuon([dict(params=[p for p in params if p.ndim >= 2]),
                                dict(params=[p for p in params if p.ndim < 2], use_muon=False, lr=ADAMW_LR)],
                               lr=MUON_LR, ns_dtype=ns_dtype)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 16, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 2, generator=g)


def _train(model, opt, steps, rank: int = 0, world: int = 1) -> None:
    x, y = _data()
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    for s in steps:
        opt.zero_grad()
        F.mse_loss(model(x[s, part]), y[s, part]).backward()
        opt.step()


def _counting_newton_schulz(calls: list):
    """newton_schulz_, recording the shape of each batch it orthogonalizes."""
    def counting(x, *args):
        calls.append(tuple(x.shape))
        NEWTON_SCHULZ(x, *args)
    return counting


def _mesh(shape: tuple):
    return init_device_mesh("cpu", shape, mesh_dim_names=HSDP_DIMS if len(shape) == 2 else None)


def _sharded_runs(rank: int, shape: tuple, path: str) -> dict:
    """Each ns_dtype trained STEPS steps on a mesh of this shape, with the
    matrices each rank orthogonalized in all (per shape); the fp32 run saved
    at SAVED_AT, and whether its momentum is a DTensor of its parameter's
    placements, live and saved."""
    mesh, world = _mesh(shape), math.prod(shape)
    placements = (Shard(0),) if len(shape) == 1 else (Replicate(), Shard(0))
    result = {}
    for name, ns_dtype in NS_DTYPES.items():
        calls = []
        _muon_layout.newton_schulz_ = _counting_newton_schulz(calls)
        model = _model(mesh)
        opt = _optimizer(model, ns_dtype)
        _train(model, opt, range(SAVED_AT), rank, world)
        if name == "fp32":
            state = _state(model, opt)
            saved = [s["momentum_buffer"] for s in state["optim"]["state"].values() if "momentum_buffer" in s]
            live = [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]]
            result["momentum is a DTensor of its parameter's placements"] = len(saved) == len(live) == 5 and all(
                isinstance(b, DTensor) and tuple(b.placements) == placements for b in saved + live)
            dcp.save(state, checkpoint_id=path)
        _train(model, opt, range(SAVED_AT, STEPS), rank, world)
        result[name] = [t.numpy() for t in _full(model)]
        result[name + " orthogonalized"] = Counter()
        for batch in calls:
            result[name + " orthogonalized"][batch[1:]] += batch[0]
    return result


SKIPPED_STEP, INIT_SCALE = 1, 2.0 ** 8


def _scaled_run(rank: int, world: int) -> dict:
    """fp32 training under a GradScaler, rank 1's shard of up.weight's
    gradient made inf at SKIPPED_STEP: the parameters after that step, the
    scale at the end, the final parameters."""
    model = _model(init_device_mesh("cpu", (world,)))
    opt = _optimizer(model, torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    x, y = _data()
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    result = {}
    for s in range(STEPS):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x[s, part]), y[s, part])).backward()
        if s == SKIPPED_STEP:
            before = _full(model)
            if rank == 1:
                model.up.weight.grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if s == SKIPPED_STEP:
            result["skipped step left the parameters"] = all(torch.equal(a, b) for a, b in zip(before, _full(model)))
    result["scale"] = scaler.get_scale()
    result["final"] = [t.numpy() for t in _full(model)]
    return result


def _hsdp_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """On HSDP's 2 x 2 mesh: the runs of every ns_dtype, the fp32 one saved."""
    with _rank_group(rank, world, port, out):
        out.put((rank, _sharded_runs(rank, (2, 2), f"{path}/2x2")))
    _exit()


def _save_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """At 2 ranks: the runs of every ns_dtype (the fp32 one saved), the
    GradScaler run, and HSDP's checkpoint resumed."""
    with _rank_group(rank, world, port, out):
        result = _sharded_runs(rank, (world,), f"{path}/2")
        result["scaled"] = _scaled_run(rank, world)
        model, opt = _resumed(f"{path}/2x2", rank, world, _mesh((world,)))
        result["resumed from 2x2"] = [t.numpy() for t in _full(model)]
        momenta = [(opt.state[p]["momentum_buffer"], p) for p in opt.param_groups[0]["params"]]
        result["resumed momentum placed as its parameter"] = all(
            isinstance(b, DTensor) and tuple(b.placements) == tuple(p.placements) == (Shard(0),) for b, p in momenta)
        out.put((rank, result))
    _exit()


def _resumed(path: str, rank: int, world: int, mesh=None) -> tuple[Model, shardadam.FusedMuon]:
    """An fp32 checkpoint loaded (FSDP2 on `mesh`, or the plain model), trained on to STEPS."""
    model = _model(mesh)
    opt = _optimizer(model, torch.float32)
    _load(model, opt, path)
    _train(model, opt, range(SAVED_AT, STEPS), rank, world)
    return model, opt


def _three_worker(rank: int, world: int, port: int, path: str, out) -> None:
    """At 3 ranks: the runs of every ns_dtype, and the 2-rank checkpoint resumed."""
    with _rank_group(rank, world, port, out):
        result = _sharded_runs(rank, (world,), f"{path}/3")
        result["resumed"] = [t.numpy() for t in _full(_resumed(f"{path}/2", rank, world, _mesh((world,)))[0])]
        out.put((rank, result))
    _exit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Mesh shape -> each rank's results (in the mesh's row-major order); the
    checkpoints' folder under "path". HSDP runs first: the 2 ranks resume its
    checkpoint."""
    path = str(tmp_path_factory.mktemp("dcp-muon"))
    hsdp = _spawn_all(_hsdp_worker, 4, path)
    return {(2, 2): hsdp, (2,): _spawn_all(_save_worker, 2, path), (3,): _spawn_all(_three_worker, 3, path),
            "path": path}


@functools.lru_cache(maxsize=None)
def _plain(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(initial, final) parameters of FusedMuon on the unsharded model, the global batch."""
    model = _model()
    start = _full(model)
    _train(model, _optimizer(model, NS_DTYPES[name]), range(STEPS))
    return start, _full(model)


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_sharded_fp32_training_equals_the_unsharded_model(runs, shape):
    for rank, result in enumerate(runs[shape]):
        for i, (got, want) in enumerate(zip(result["fp32"], _plain("fp32")[1])):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, parameter {i}: {m}")


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_sharded_bf16_training_is_within_bf16_noise_of_the_unsharded_model(runs, shape):
    start, fp32 = _plain("fp32")
    bf16 = _plain("bf16")[1]
    noise = _movement_error(bf16, fp32, start)
    assert noise > 1e-4, "bf16 Newton-Schulz must move the run measurably (else the bound says nothing)"
    for rank, result in enumerate(runs[shape]):
        error = _movement_error(result["bf16"], bf16, start)
        assert error <= 2 * noise, (f"rank {rank}'s sharded bf16 run is {error:.2%} away from the plain one "
                                    f"(bf16 noise {noise:.2%})")


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_each_matrix_is_orthogonalized_once_and_the_ranks_share_the_work(runs, shape):
    """Each 2-D matrix once on the whole mesh (under HSDP not once per
    replica: the replicas share the work); each rank its own experts'
    matrices (under HSDP, each replica its copy)."""
    shards, replicas = shape[-1], math.prod(shape[:-1])
    expected = Counter({s: n * (replicas if s == (24, 12) else 1) for s, n in MATRICES.items()})
    for name in NS_DTYPES:
        done = [Counter({s: n // STEPS for s, n in result[name + " orthogonalized"].items()})
                for result in runs[shape]]
        total = sum(done, Counter())
        assert total == expected and sum(sum(d.values()) for d in done) * STEPS == sum(
            sum(result[name + " orthogonalized"].values()) for result in runs[shape]), (
            f"{name}: the ranks orthogonalized {dict(total)} per step, not {dict(expected)}")
        experts = [_muon_dtensor.row_ranges(5, shards)[rank % shards] for rank in range(len(done))]
        assert [d[(24, 12)] for d in done] == [end - start for start, end in experts], (
            "each rank orthogonalizes its own experts' matrices, and only those")
        cost = [sum(n * _newton_schulz.ns_cost(s) for s, n in d.items()) for d in done]
        largest = max(_newton_schulz.ns_cost(s) for s in MATRICES)
        assert max(cost) - min(cost) <= largest, f"{name}: Newton-Schulz work per rank {cost} is not balanced"
        assert all(sum(d[s] for s in d if s != (24, 12)) for d in done), (
            f"{name}: every rank owns some of the sharded matrices: {done}")


def test_grad_scaler_skips_on_every_rank_when_one_rank_overflows_and_unscales_otherwise(runs):
    """torch's GradScaler unscales DTensor gradients with a found-inf flag
    reduced over the mesh, so an overflow on one rank's shard skips the step
    on every rank and every scaler backs off alike; the other steps equal the
    unscaled run (fp32: the power-of-two scale is exact), the AdamW biases and
    the momentum (which mixes gradients of two scales) included."""
    model = _model()
    _train(model, _optimizer(model, torch.float32), [s for s in range(STEPS) if s != SKIPPED_STEP])
    for rank, result in enumerate(runs[(2,)]):
        scaled = result["scaled"]
        assert scaled["skipped step left the parameters"], f"rank {rank} stepped past rank 1's overflow"
        assert scaled["scale"] == INIT_SCALE / 2, f"rank {rank}'s scaler did not back off: {scaled['scale']}"
        for i, (got, want) in enumerate(zip(scaled["final"], _full(model))):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, parameter {i}: {m}")


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_momentum_is_a_dtensor_of_its_parameters_placements_live_and_saved(runs, shape):
    assert all(result["momentum is a DTensor of its parameter's placements"] for result in runs[shape])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the plain model loads in one process
def test_dcp_checkpoint_of_2_ranks_resumes_on_3_and_on_the_plain_model(runs):
    uninterrupted = [torch.from_numpy(t) for t in runs[(2,)][0]["fp32"]]
    on_one = _full(_resumed(f"{runs['path']}/2", 0, 1)[0])  # plain FusedMuon on the unsharded model: the global batch
    for where, got in (("3 ranks", runs[(3,)][0]["resumed"]), ("the plain model", on_one)):
        for i, (g, want) in enumerate(zip(got, uninterrupted)):
            torch.testing.assert_close(torch.as_tensor(g), want, rtol=0, atol=1e-5,
                                       msg=lambda m: f"resumed on {where}, parameter {i}: {m}")


def test_dcp_checkpoint_of_hsdp_resumes_on_a_1d_mesh_of_2_ranks(runs):
    uninterrupted = [torch.from_numpy(t) for t in runs[(2, 2)][0]["fp32"]]
    for rank, result in enumerate(runs[(2,)]):
        assert result["resumed momentum placed as its parameter"], f"rank {rank}: momentum not Shard(0) after the load"
        for i, (got, want) in enumerate(zip(result["resumed from 2x2"], uninterrupted)):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, parameter {i}: {m}")


def test_assignment_balances_largest_first_and_is_deterministic():
    costs = [5, 9, 2, 9, 4]
    # 9 -> 0, 9 -> 1 (ties: the lower rank, then the earlier matrix), 5 -> 0, 4 -> 1, 2 -> 1: loads 14, 15.
    assert _newton_schulz.assign_owners(costs, [0, 0]) == [0, 0, 1, 1, 1]
    assert _newton_schulz.assign_owners(costs, [20, 0, 0]) == [1, 1, 2, 2, 2]  # rank 0 already holds 20
    assert _muon_dtensor.row_ranges(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert _muon_dtensor.row_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _placed(mesh, placements) -> nn.Parameter:
    return nn.Parameter(DTensor.from_local(torch.randn(6, 4), mesh, placements, run_check=False))


def test_other_placements_are_refused_before_anything_is_written(one_rank):
    row_sharded = distribute_tensor(torch.randn(6, 4), one_rank, [Shard(0)])
    hsdp = init_device_mesh("cpu", (1, 1), mesh_dim_names=HSDP_DIMS)
    three_d = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=HSDP_DIMS + ("tp",))
    shardadam.FusedMuon([row_sharded, _placed(hsdp, [Replicate(), Shard(0)])])  # the two accepted layouts
    for mesh, bad in ((one_rank, [Shard(1)]), (one_rank, [Replicate()]),  # tensor parallelism's columns, replicas
                      (hsdp, [Shard(0), Replicate()]), (hsdp, [Replicate(), Shard(1)]),
                      (hsdp, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 over tensor parallelism's rows
                      (hsdp, [Replicate(), _StridedShard(0, split_factor=2)]),
                      (three_d, [Replicate(), Shard(0), Replicate()]), (three_d, [Replicate(), Shard(0), Shard(1)])):
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] is a DTensor laid out as "
                                             rf"\({re.escape(repr(bad[0]))}.* over .*Shard\(0\) on a 1-D mesh .*"
                                             r"\(Replicate\(\), Shard\(0\)\) on a 2-D mesh \(FSDP2's HSDP"):
            shardadam.FusedMuon([row_sharded, _placed(mesh, bad)])
    with pytest.raises(ValueError, match=r"\['params'\]\[0\] is laid out as .* a 2-D mesh without dim names"):
        shardadam.FusedMuon([_placed(init_device_mesh("cpu", (1, 1)), [Replicate(), Shard(0)])])
    model = nn.Linear(4, 6)
    fully_shard(model, mesh=one_rank, shard_placement_fn=lambda p: Shard(p.ndim - 1))
    with pytest.raises(ValueError, match=r"\(Shard\(dim=1\),\) over .*redistribute it to one of those"):
        shardadam.FusedMuon([model.weight])
    p = nn.Parameter(row_sharded)
    opt = shardadam.FusedMuon([p])
    before = p.to_local().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] is a DTensor"):
        opt.add_param_group(dict(params=[model.weight]))
    assert len(opt.param_groups) == 1
    p.grad = distribute_tensor(torch.randn(6, 4), one_rank, [Replicate()])
    with pytest.raises(ValueError, match="laid out as"):
        opt.step()
    assert torch.equal(p.to_local(), before) and not opt.state, "a refused step wrote something"
