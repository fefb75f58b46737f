"""torch.compile'd models train as eager ones with FusedAdam and with
DistributedFusedAdam (overlap_grad_sync's post-accumulate-grad hooks and
overlap_param_sync's module forward-pre hooks under a compiled forward and
backward). CPU, one gloo rank in this process.

On the CPU the backend is aot_eager (dynamo and AOT autograd, where the hooks
meet the compiler), and inductor for DistributedFusedAdam, whose forward-pre
hook inductor once failed inside (its C++ build takes about half a minute on
a 2-core machine). No run breaks the graph: overlap_param_sync's waits are an
operator in it ([Note: waits inside compiled graphs] in
distributed/_compiled_wait.py). The CUDA test runs inductor; every overlap mode
on 2 ranks: test_compile_ranks.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import shardadam

STEPS = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Scaled(nn.Module):
    """Reads a parameter of an nn.ParameterList, whose own forward (and hook) never runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 4))
        self.scales = nn.ParameterList([nn.Parameter(torch.linspace(0.5, 1.5, 4))])

    def forward(self, x):
        return self.body(x) * self.scales[0]


def _model(device: str = "cpu", kind: type = None):
    torch.manual_seed(0)
    if kind is not None:
        return kind().to(device)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4)).to(device)


def _train(model, opt, backend: str | None) -> list[float]:
    run = torch.compile(model, backend=backend) if backend else model
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        loss = F.mse_loss(run(x), y)
        loss.backward()
        opt.clip_grad_norm(1.0) if isinstance(opt, shardadam.DistributedFusedAdam) else None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, shardadam.DistributedFusedAdam):
        opt.param_sync()
    return losses


def _compare(make_optimizer, backend: str = "aot_eager", device: str = "cpu", kind: type = None):
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _model(device, kind), _model(device, kind)
    want = _train(eager, make_optimizer(eager), backend=None)
    got = _train(compiled, make_optimizer(compiled), backend=backend)
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    start = _model(device, kind).state_dict()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert not torch.equal(p, start[name]), f"{name} did not train"
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_compiled_model_with_fused_adam_trains_as_eager():
    _compare(lambda m: shardadam.FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1))


@pytest.mark.cuda
def test_inductor_compiled_model_with_fused_adam_trains_as_eager_on_cuda():
    _compare(lambda m: shardadam.FusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1), "inductor", "cuda")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-hooks", "no-overlap"])
def test_compiled_model_with_distributed_fused_adam_trains_as_eager(one_rank, overlap):
    _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                                      overlap_grad_sync=overlap, overlap_param_sync=overlap))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-hooks", "no-overlap"])
def test_inductor_compiled_model_with_distributed_fused_adam_trains_as_eager(one_rank, overlap):
    """Inductor traced overlap_param_sync's forward-pre hook and failed inside it
    (InternalTorchDynamoError: KeyError in the first-use guard's bookkeeping);
    then the hook ran outside the compiled graph, a graph break per module
    whose parameters it waited for. Now nothing breaks the graph."""
    _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                                      overlap_grad_sync=overlap, overlap_param_sync=overlap),
             "inductor")


@pytest.mark.cuda
def test_inductor_compiled_model_with_distributed_fused_adam_trains_as_eager_on_cuda():
    """The wait operator on CUDA parameters, in a one-rank NCCL group: the
    all-gathers run on NCCL's stream and the compiled forward waits for them."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                          bucket_cap_mb=1e-4, overlap_param_sync=True),
                 "inductor", "cuda")
    finally:
        dist.destroy_process_group()


def test_compiled_read_outside_a_modules_forward_waits_in_the_graph(one_rank):
    """A parameter no hook waits for (an nn.ParameterList's) waits at its first
    use in the compiled graph, as in eager mode ([Note: first-use guard])."""
    _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                                      overlap_param_sync=True), kind=Scaled)
