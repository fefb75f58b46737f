"""torch.compile'd models train as eager ones with FusedAdam and with
DistributedFusedAdam (overlap_grad_sync's post-accumulate-grad hooks and
overlap_param_sync's module forward-pre hooks under a compiled forward and
backward). CPU, one gloo rank in this process.

On the CPU the backend is aot_eager (dynamo and AOT autograd, where the hooks
meet the compiler), and inductor for DistributedFusedAdam, whose forward-pre
hook inductor once failed inside ([Note: hooks outside compiled graphs] in
distributed/_hooks.py; its C++ build takes about half a minute on a 2-core
machine). The CUDA test runs inductor."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardadam

STEPS = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _model(device: str = "cpu"):
    torch.manual_seed(0)
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


def _compare(make_optimizer, backend: str = "aot_eager", device: str = "cpu"):
    torch._dynamo.reset()
    eager, compiled = _model(device), _model(device)
    want = _train(eager, make_optimizer(eager), backend=None)
    got = _train(compiled, make_optimizer(compiled), backend=backend)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    start = _model(device).state_dict()
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
    the hook now runs outside the compiled graph (a graph break per module
    whose parameters it waits for)."""
    _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                                      overlap_grad_sync=overlap, overlap_param_sync=overlap),
             "inductor")


@pytest.mark.cuda
def test_inductor_compiled_model_with_distributed_fused_adam_trains_as_eager_on_cuda():
    """overlap_param_sync's waits with CUDA parameters in a one-rank NCCL
    group: the all-gathers run on NCCL's stream and each compiled module's
    forward must see its parameters' new values."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        _compare(lambda m: shardadam.DistributedFusedAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                          bucket_cap_mb=1e-4, overlap_param_sync=True),
                 "inductor", "cuda")
    finally:
        dist.destroy_process_group()
