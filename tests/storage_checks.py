"""Checks every low-precision storage kind shares (tests/test_fp8_states.py,
tests/test_blockwise_states.py, tests/test_stochastic_rounding.py): a few
steps on random gradients, checkpoints through fp32 storage, a captured step
against eager ones, and short training runs."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

import shardadam
from shardadam import kernels


BLOCK = 256  # elements per block of the blockwise 8-bit states


def blockwise_reference_map(signed: bool) -> torch.Tensor:
    """The documented map of the blockwise 8-bit states: magnitude code c in
    [2^k, 2^(k+1)) is decade z = top - k, the j-th of 2^k grid points above
    10^-(z+1) (0 for the bottom decade) up to 10^-z; signed codes keep the
    sign in bit 7."""
    top = 6 if signed else 7
    magnitude = [0.0]
    for c in range(1, 2 << top):
        k = int(math.floor(math.log2(c)))
        z, n, j = top - k, 2 ** k, c - 2 ** k + 1
        lower, upper = (10.0 ** -(z + 1) if z < top else 0.0), 10.0 ** -z
        magnitude.append(upper if j == n else lower + j * (upper - lower) / n)
    values = torch.tensor(magnitude, dtype=torch.float64).float()
    return torch.cat([values, -values]) if signed else values


def blockwise_rows(x: torch.Tensor) -> torch.Tensor:
    """x flat, zero-padded to whole blocks, one row per block."""
    flat = x.reshape(-1).double()
    return torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)


def blockwise_quantized(t: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """t as blockwise storage keeps it, and its codes: the nearest map value
    per element (reference search, float64) times its block's maximum."""
    table = blockwise_reference_map(signed).double()
    rows = blockwise_rows(t.cpu())
    absmax = rows.abs().amax(dim=1, keepdim=True)
    y = torch.where(absmax > 0, rows / absmax, torch.zeros_like(rows)).reshape(-1, 1)
    codes = (y - table[None, :]).abs().argmin(dim=1).view_as(rows)
    values = (table[codes].float() * absmax.float()).reshape(-1)[:t.numel()].view_as(t).to(t.device)
    return values, codes.reshape(-1)[:t.numel()].view_as(t)


def assert_blockwise_state(opt, p: torch.Tensor, name: str, expect: torch.Tensor) -> None:
    """opt's state `name` of p is blockwise and decodes to the reference's
    quantized value `expect` (a value that fp32 rounding put on the other side
    of a tie may differ by one map step; the block maxima may differ in the
    last bit where the compiler fused a multiply-add that torch rounds twice)."""
    signed = name != "exp_avg_sq"
    assert opt.state[p][name].dtype == torch.uint8, name
    assert opt.state[p][f"{name}_absmax"].numel() == -(-p.numel() // BLOCK), name
    got = torch.empty_like(p, dtype=torch.float32)
    kernels.blockwise_dequantize(opt.state[p][name], opt.state[p][f"{name}_absmax"], got, signed=signed)
    step = expect.abs().max() * 0.9 / 64  # one step of the finest decade
    assert (got - expect).abs().max() <= step, name
    codes = blockwise_quantized(expect, signed=signed)[1]
    assert (opt.state[p][name].cpu().long() != codes).float().mean() < 0.01, name


def random_steps(opt, params, steps: int = 3) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def reloaded_through_fp32(model: nn.Module, **storage):
    """FusedAdam in `storage` stepped three times; its state dict holds fp32
    values, which an fp32-state FusedAdam loads and saves back unchanged; that
    dict loaded into `storage` again. Returns (stepped optimizer, reloaded one)."""
    opt = shardadam.FusedAdam(model.parameters(), lr=1e-2, **storage)
    random_steps(opt, list(model.parameters()))
    saved = opt.state_dict()
    assert all(v.dtype == torch.float32 for e in saved["state"].values() for k, v in e.items() if k != "step")
    fp32 = shardadam.FusedAdam(model.parameters(), lr=1e-2)
    fp32.load_state_dict(saved)
    again = fp32.state_dict()
    for k, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(again["state"][k][name], value), (k, name)
    back = shardadam.FusedAdam(model.parameters(), lr=1e-2, **storage)
    back.load_state_dict(again)
    return opt, back


def lion_or_adamw(model: nn.Module, lion: bool, **storage):
    """(shardadam optimizer in `storage`, the torch reference on copies of the
    parameters, the copies, the states to compare) for Lion or AdamW at lr
    1e-2, weight decay 0.1."""
    want = [p.detach().clone().requires_grad_() for p in model.parameters()]
    if lion:
        from torch_lion import TorchLion
        storage.pop("exp_avg_sq_dtype", None)
        return (shardadam.FusedLion(model.parameters(), lr=1e-2, weight_decay=0.1, **storage),
                TorchLion(want, lr=1e-2, weight_decay=0.1), want, ("exp_avg",))
    return (shardadam.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **storage),
            torch.optim.AdamW(want, lr=1e-2, weight_decay=0.1, foreach=False), want, ("exp_avg", "exp_avg_sq"))


def steps_on_quantized_states(model: nn.Module, opt, reference, want: list, names: tuple, quantized,
                              steps: int = 4) -> None:
    """`steps` steps of both optimizers on the same random gradients; after
    each, the reference's states are replaced by quantized(state, name): what
    the storage under test keeps of them."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g).to(device) for p in want]
        for p, q, grad in zip(model.parameters(), want, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
        with torch.no_grad():
            for q in want:
                for name in names:
                    reference.state[q][name].copy_(quantized(reference.state[q][name], name))


def captured_against_eager(make, steps: int = 3):
    """make() -> (parameter, optimizer), twice: one stepped `steps` times
    eagerly, one by a warm-up step (which builds its plan), then a CUDA graph
    capture of step() replayed for the rest. Returns both pairs."""
    eager_p, eager = make()
    for _ in range(steps):
        eager.step()
    p, opt = make()
    replay_captured_step(opt, steps - 1)
    return (eager_p, eager), (p, opt)


def replay_captured_step(opt, replays: int = 2) -> None:
    """Capture opt.step() in a CUDA graph (after a warm-up step that built its
    plan) and replay it `replays` times: replays + 1 steps in all."""
    opt.step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt.step()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(replays):
        graph.replay()


def small_model_run(optimizer, steps: int = 5, width: int = 32):
    """A two-layer model trained from seed 0 on fixed batches by
    optimizer(parameters). Returns (model, optimizer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = optimizer(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, width, generator=g)).pow(2).mean().backward()
        opt.step()
    return model, opt


def distributed_equals_fused(storage: dict, width: int = 32):
    """One rank, one bucket (every shard fragment a whole parameter):
    DistributedFusedAdam in `storage` trains bit for bit as FusedAdam and
    saves the same states. Returns the distributed optimizer."""
    kw = dict(lr=1e-2, weight_decay=0.1, **storage)
    fused_model, fused = small_model_run(lambda ps: shardadam.FusedAdam(ps, **kw), width=width)
    dist_model, dist_opt = small_model_run(lambda ps: shardadam.DistributedFusedAdam(
        ps, bucket_cap_mb=100, overlap_grad_sync=False, **kw), width=width)
    for p, q in zip(fused_model.parameters(), dist_model.parameters()):
        assert torch.equal(p, q)
    saved, mine = fused.state_dict()["state"], dist_opt.state_dict()["state"]
    for k in saved:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[k][name], saved[k][name]), (k, name)
    return dist_opt


def distributed_reloaded_through_fp32(storage: dict, bucket_cap_mb: float, width: int = 32):
    """DistributedFusedAdam in `storage`, trained; its portable state dict
    holds fp32 values that an fp32-state optimizer loads and gives back
    unchanged. Returns (model, optimizer, its state dict, the fp32 optimizer)."""
    kw = dict(lr=1e-2, bucket_cap_mb=bucket_cap_mb, overlap_grad_sync=False)
    model, opt = small_model_run(lambda ps: shardadam.DistributedFusedAdam(ps, **storage, **kw), width=width)
    saved = opt.state_dict()
    fp32 = shardadam.DistributedFusedAdam(model.parameters(), **kw)
    fp32.load_state_dict(saved)
    again = fp32.state_dict()["state"]
    for k, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(again[k][name], value), (k, name)
    return model, opt, saved, fp32


def steps_on_cpu_and_cuda(numel: int, **storage) -> None:
    """Three FusedAdam steps of one parameter on each engine from the same
    values: parameters within fp32 rounding, stored bytes equal but for rare
    ties (the compilers contract the update's multiply-adds differently)."""
    def run(device):
        p = nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device))
        opt = shardadam.FusedAdam([p], lr=1e-2, **storage)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            p.grad = torch.randn(numel, generator=g).to(device)
            opt.step()
        return p.detach().cpu(), [opt.state[p][n].view(torch.uint8).cpu() for n in ("exp_avg", "exp_avg_sq")]
    (p_cpu, s_cpu), (p_gpu, s_gpu) = run("cpu"), run("cuda")
    torch.testing.assert_close(p_gpu, p_cpu, rtol=1e-6, atol=1e-7)
    for a, b in zip(s_cpu, s_gpu):
        assert (a != b).float().mean() < 1e-3
