"""torch.compile'd models on 2 ranks with DistributedFusedAdam in every
overlap mode (overlap_grad_sync x overlap_param_sync): no graph break, and
the trained parameters equal those of the same optimizer on the uncompiled
model and of one process running AdamW on the global batch (DDP + AdamW).
overlap_param_sync's waits are an operator in the graph ([Note: waits inside
compiled graphs] in distributed/_compiled_wait.py). Each rank trains the four
modes one after the other in one process (inductor's C++ build is paid once
per graph, not per mode)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import shardadam
from test_distributed import STEPS, _exit, _frozen, _groups, _model, _rank_group, _reference, _spawn, _train

MODES = [(grad, param) for grad in (True, False) for param in (True, False)]


def _trained(device: str, rank: int, world: int, backend: str | None, overlap_grad: bool, overlap_param: bool):
    """The parameters after STEPS steps, on the CPU."""
    model = _model().to(device)
    frozen = _frozen(model)
    frozen.requires_grad_(False)
    opt = shardadam.DistributedFusedAdam(_groups(model, frozen), lr=1e-2, weight_decay=0.1, bucket_cap_mb=1e-4,
                                         overlap_grad_sync=overlap_grad, overlap_param_sync=overlap_param)
    _train(torch.compile(model, backend=backend) if backend else model, opt, rank, world, range(STEPS))
    opt.param_sync()
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def _compile_worker(rank: int, world: int, port: int, backend: str, device: str, out) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    with _rank_group(rank, world, port, out, "nccl" if device == "cuda" else "gloo"):
        where = device if device == "cpu" else f"cuda:{rank}"
        results = []
        for overlap_grad, overlap_param in MODES:
            torch._dynamo.reset()
            counters.clear()
            compiled = _trained(where, rank, world, backend, overlap_grad, overlap_param)
            breaks = {str(reason): n for reason, n in counters["graph_break"].items()}
            eager = _trained(where, rank, world, None, overlap_grad, overlap_param)
            results.append(dict(mode=(overlap_grad, overlap_param), compiled=compiled, eager=eager, breaks=breaks))
        if rank == 0:
            out.put(results)
    _exit()


def _check(backend: str, device: str = "cpu") -> None:
    want = _reference(2)[0]
    for result in _spawn(_compile_worker, 2, backend, device):
        mode = "overlap_grad_sync={}, overlap_param_sync={}".format(*result["mode"])
        assert not result["breaks"], f"{mode}: graph breaks {result['breaks']}"
        for i, (got, eager, ref) in enumerate(zip(result["compiled"], result["eager"], want)):
            got, eager = torch.from_numpy(got), torch.from_numpy(eager)
            if backend == "aot_eager":  # the eager kernels, in the same order
                torch.testing.assert_close(got, eager, rtol=0, atol=0, msg=lambda m: f"{mode}, param {i}: {m}")
            else:  # inductor's fused kernels round differently
                torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode}, param {i}: {m}")
            torch.testing.assert_close(got, ref.contiguous(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{mode}, param {i} against AdamW: {m}")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_model_trains_without_graph_breaks_in_every_overlap_mode(backend):
    _check(backend)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_inductor_compiled_model_trains_without_graph_breaks_in_every_overlap_mode_on_cuda():
    _check("inductor", "cuda")
