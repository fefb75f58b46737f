"""The engine's gradient scale (distributed/_grad_scaling.py) alone, on a
stand-in engine (no process group): averaging, unscaling, the GradScaler's
stage checks, inf/NaN skips and deferred clipping, against float64 math.
The spawned runs of test_distributed.py cover them inside whole iterations."""
from __future__ import annotations

import logging

import pytest
import torch

from shardadam.distributed._grad_scaling import GradScaling
from shardadam.distributed._iteration import Iteration

FP32_ULP = 2.0 ** -23


class _Engine(GradScaling):
    """What GradScaling reads of the engine; the all-reduced inf flag is given."""

    def __init__(self, world_size=4, average_grad_sync=True, skip_nonfinite_grads=False, capturable=False,
                 found=0.0):
        self.world_size, self.average_grad_sync = world_size, average_grad_sync
        self.skip_nonfinite_grads, self.capturable = skip_nonfinite_grads, capturable
        self.device = torch.device("cpu")
        self.iteration = Iteration()
        self.skipped_steps = torch.zeros((), dtype=torch.int64) if capturable else 0
        self._grad_scaler = None
        self.found = found

    def _nonfinite_on_any_rank(self) -> torch.Tensor:
        return torch.tensor(self.found)


def _scaler(scale: float) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    return scaler


def _close(actual: torch.Tensor, expected: float, ulps: int = 2) -> None:
    assert actual.dtype == torch.float32 and actual.shape == ()
    assert abs(actual.item() - expected) <= ulps * FP32_ULP * abs(expected), (actual.item(), expected)


@pytest.mark.parametrize("world_size, average", [(4, True), (3, True), (4, False)])
def test_averaging_alone(world_size, average):
    engine = _Engine(world_size, average)
    grad_scale, found_inf = engine._gradient_scale(None, None)
    _close(grad_scale, 1.0 / world_size if average else 1.0, ulps=1)
    assert found_inf is None


def test_unscale_grads_factor_and_loss_scale_multiply_in():
    engine = _Engine(world_size=3)
    engine.iteration.inv_scale = torch.tensor(1 / 96.0)
    grad_scale, _ = engine._gradient_scale(None, None)
    _close(grad_scale, (1 / 3) * (1 / 96.0))
    engine.iteration.inv_scale = None
    scaler = _scaler(512.0)
    grad_scale, found_inf = engine._gradient_scale(scaler, engine._scaler_inv_scale(scaler))
    _close(grad_scale, (1 / 3) / 512.0)
    assert found_inf.item() == 0.0 and engine._grad_scaler is scaler
    assert scaler._per_optimizer_states[id(engine)]["found_inf_per_device"] == {engine.device: found_inf}


def test_scaler_stage_checks():
    engine = _Engine()
    scaler = _scaler(64.0)
    assert engine._scaler_inv_scale(None) is None
    _close(engine._scaler_inv_scale(scaler), 1 / 64.0, ulps=0)
    engine.iteration.inv_scale = torch.tensor(1 / 64.0)  # unscale_grads(inv_scale=...) ran
    with pytest.raises(RuntimeError, match="^the GradScaler steps gradients that unscale_grads"):
        engine._scaler_inv_scale(scaler)
    engine.iteration.inv_scale = None
    state = scaler._per_optimizer_states[id(engine)]
    assert state["stage"].name == "READY"
    state["stage"] = type(state["stage"]).UNSCALED  # scaler.unscale_(engine), which cannot reach the gradients
    with pytest.raises(RuntimeError, match=r"^scaler.unscale_\(optimizer\) cannot reach _Engine's gradients"):
        engine._scaler_inv_scale(scaler)
    engine.iteration.inv_scale = torch.tensor(1 / 64.0)  # unscale_grads(grad_scaler=scaler) ran
    assert engine._scaler_inv_scale(scaler) is None


def test_skips_count_and_log_only_where_asked(caplog):
    assert not _Engine()._skips(None)
    assert not _Engine(found=1.0)._skips(torch.tensor(0.0))
    with_scaler = _Engine()
    assert with_scaler._skips(torch.tensor(1.0)) and with_scaler.skipped_steps == 0
    counted = _Engine(skip_nonfinite_grads=True)
    with caplog.at_level(logging.WARNING, logger="shardadam"):
        assert counted._skips(torch.tensor(1.0)) and counted._skips(torch.tensor(1.0))
    assert counted.skipped_steps == 2
    assert "_Engine: step skipped on every rank" in caplog.text and "(2 steps skipped so far)" in caplog.text


def test_capturable_skips_are_decided_on_the_device():
    engine = _Engine(skip_nonfinite_grads=True, capturable=True, found=1.0)
    _, found_inf = engine._gradient_scale(None, None)
    assert not engine._skips(found_inf)  # the kernel reads found_inf itself
    assert engine.skipped_steps.item() == 1


@pytest.mark.parametrize("norm, max_norm", [(8.0, 1.0), (0.5, 1.0), (3.0, 3.0)])
@pytest.mark.parametrize("world_size, average", [(4, True), (2, False)])
def test_clip_uses_the_unscaled_norm(norm, max_norm, world_size, average):
    """clip_grad_norm() stored the loss-scaled norm of the averaged
    gradients; step() clips on the unscaled one, as
    torch.nn.utils.clip_grad_norm_'s coefficient (eps 1e-6)."""
    loss_scale = 1024.0
    engine = _Engine(world_size, average)
    engine.iteration.clip = (max_norm, torch.tensor(norm * loss_scale))
    scaler = _scaler(loss_scale)
    grad_scale, _ = engine._gradient_scale(scaler, engine._scaler_inv_scale(scaler))
    engine._clip_into(grad_scale)
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    _close(grad_scale, (1.0 / world_size if average else 1.0) / loss_scale * coefficient, ulps=4)


def test_no_clip_leaves_the_scale():
    engine = _Engine()
    grad_scale = torch.tensor(0.25)
    engine._clip_into(grad_scale)
    assert grad_scale.item() == 0.25
