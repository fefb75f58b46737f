"""DistributedFusedAdam(capturable=True): a whole iteration (zero_grad,
forward with overlapped all-gathers, backward with overlapped reduce-scatters,
clipping, GradScaler step and update) captured in one CUDA graph and replayed,
against single-process torch.optim.AdamW on the global batch (what DDP + AdamW
computes), with an LR scheduler writing the lr tensors between replays and a
non-finite gradient on one rank skipping the step everywhere, on the device.

The workers are test_distributed's; this module holds the captured training
loop they run when asked to capture."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from test_distributed import GLOBAL_BATCH, STEPS, _config, _data, _reference, _refusal_worker, _spawn, _step, _worker

WARMUP = 2  # eager steps before the capture: the first one also learns the bucket order


def train_captured(model, opt, rank: int, world: int, clip, scaler, inf_step, schedule) -> list[float]:
    """Steps 0..WARMUP-1 eagerly on a side stream (as CUDA graphs require),
    then one iteration captured and replayed for the remaining steps, each
    step's batch copied into static inputs first. At inf_step rank 1's loss
    is multiplied by inf inside the graph. Returns the pre-clip norms."""
    x, y = _data()
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    local = GLOBAL_BATCH // world
    static_x = torch.empty((local, *x.shape[2:]), device=dev, dtype=dtype)
    static_y = torch.empty((local, *y.shape[2:]), device=dev, dtype=dtype)
    blowup = torch.ones((), device=dev, dtype=dtype)

    def load(s: int) -> None:
        static_x.copy_(x[s, rank * local:(rank + 1) * local])
        static_y.copy_(y[s, rank * local:(rank + 1) * local])
        blowup.fill_(float("inf") if s == inf_step and rank == min(1, world - 1) else 1.0)

    def iteration():
        opt.zero_grad()
        loss = F.mse_loss(model(static_x), static_y) * blowup
        (scaler.scale(loss) if scaler is not None else loss).backward()
        norm = opt.clip_grad_norm(clip, grad_scaler=scaler) if clip is not None else None
        _step(opt, scaler)  # the schedule steps outside the graph, between replays
        return norm

    norms = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in range(WARMUP):
            load(s)
            norms.append(iteration())
            if schedule is not None:
                schedule.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_norm = iteration()
    for s in range(WARMUP, STEPS):
        load(s)
        graph.replay()
        norms.append(None if static_norm is None else static_norm.clone())
        if schedule is not None:
            schedule.step()  # fills the lr tensors the graph reads
    return [float(n) for n in norms] if clip is not None else []


def _check_against_adamw(result: dict, world: int, cfg: dict) -> None:
    assert result["same_on_all_ranks"], "ranks disagree on the parameters"
    assert result["frozen_unchanged"], "a frozen parameter was modified"
    want_params, want_norms, want_scale = _reference(world, model_kind=cfg["model"], scaler=cfg["scaler"],
                                                     inf_step=cfg["inf_step"], clip=cfg["clip"],
                                                     lr_schedule=cfg["lr_schedule"])
    assert result["scale"] == want_scale, "the loss scale must back off and grow exactly as torch's"
    steps_done = STEPS - (cfg["inf_step"] is not None)
    assert result["steps"] == [steps_done] * 4, "a skipped step must not count, on any rank"
    if cfg["clip"] is not None:  # unscaled under AMP: the scaler is passed to clip_grad_norm
        np.testing.assert_allclose(result["norms"], want_norms, rtol=1e-5)
    for i, (got, want) in enumerate(zip(result["params"], want_params)):
        torch.testing.assert_close(torch.from_numpy(got), want.contiguous(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"param {i}: {m}")


@pytest.mark.parametrize("world,kw", [
    pytest.param(1, dict(scaler=True, clip=0.02, overlap_param_sync=True, contiguous_param_buffer=True),
                 marks=pytest.mark.cuda),
    pytest.param(2, dict(scaler=True, inf_step=3, overlap_param_sync=True, model="reordered"),
                 marks=pytest.mark.multigpu),
    pytest.param(2, dict(clip=0.02, contiguous_grad_buffer=True, contiguous_param_buffer=True,
                         overlap_param_sync=True), marks=pytest.mark.multigpu),
    pytest.param(2, dict(scaler=True, clip=0.02, overlap=False), marks=pytest.mark.multigpu),
], ids=["nccl-1-scaler-clip", "nccl-2-scaler-inf-skips", "nccl-2-contiguous-clip", "nccl-2-no-overlap"])
def test_captured_iterations_match_single_process_adamw(world, kw):
    cfg = _config(device="cuda", capture=True, lr_schedule=True, **kw)
    _check_against_adamw(_spawn(_worker, world, cfg), world, cfg)


@pytest.mark.multigpu
def test_capturable_eager_steps_skip_on_the_device():
    """capturable=True without a graph: the same results, nothing read back."""
    cfg = _config(device="cuda", capturable=True, scaler=True, inf_step=2, lr_schedule=True, clip=0.02)
    _check_against_adamw(_spawn(_worker, 2, cfg), 2, cfg)


@pytest.mark.multigpu
@pytest.mark.parametrize("kw", [dict(dtype=torch.bfloat16, remainders=True), dict(scaled_states=True)],
                         ids=["bf16-remainders", "scaled-fp16-states"])
def test_captured_compact_states_equal_their_eager_runs(kw):
    """Remainders and scaled states (apex refuses capturable with both):
    replaying the captured iteration gives the eager capturable run's
    parameters and state bit for bit."""
    base = dict(device="cuda", overlap_param_sync=True, scaler=True, inf_step=3, lr_schedule=True, **kw)
    captured = _spawn(_worker, 2, _config(capture=True, **base))
    eager = _spawn(_worker, 2, _config(capturable=True, **base))
    assert captured["same_on_all_ranks"] and captured["steps"] == [STEPS - 1] * 4
    for name in ("params", "masters"):
        for i, (a, b) in enumerate(zip(captured[name], eager[name])):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {i}")
    assert captured["scale"] == eager["scale"]


def test_capturable_on_cpu_raises_before_touching_anything():
    result = _spawn(_refusal_worker, 2, dict(capturable=True))
    assert result["message"] is not None and "capturable=True needs CUDA" in result["message"]
    assert result["untouched"]
